//! Unit tests of the copier: registration checks, strided and packed copies, all or nothing.

use super::*;
use crate::runs;

/// A "GPU" buffer of `g` bytes and a "CPU" buffer of `c` bytes.
struct Bufs {
    gpu: Vec<u8>,
    cpu: Vec<u8>,
}

impl Bufs {
    fn new(g: usize, c: usize) -> Self {
        Self {
            gpu: (0..g).map(|i| (i % 251) as u8 + 1).collect(),
            cpu: vec![0; c],
        }
    }

    fn spans(&mut self) -> Vec<Span> {
        vec![
            Span {
                base: self.gpu.as_mut_ptr() as usize,
                len: self.gpu.len(),
            },
            Span {
                base: self.cpu.as_mut_ptr() as usize,
                len: self.cpu.len(),
            },
        ]
    }
}

fn space(buffer: usize, offset: usize, stride: usize) -> RowSpace {
    RowSpace {
        buffer,
        offset,
        stride,
    }
}

fn runs(group: usize, gpu: &[i64], cpu: &[i64], counts: &[i64]) -> Runs {
    Runs {
        group,
        region: None,
        gpu: gpu.to_vec(),
        cpu: cpu.to_vec(),
        counts: counts.to_vec(),
    }
}

/// One group, one region: 3 GPU rows of 500 bytes at stride 1000, 5 CPU rows at 600.
fn strided(b: &mut Bufs) -> Copier {
    let g = Group {
        gpu_rows: 3,
        cpu_rows: 5,
        regions: vec![Region {
            gpu: space(0, 0, 1000),
            cpu: space(1, 0, 600),
            row_bytes: 500,
        }],
    };
    // SAFETY: the buffers outlive the copier in every test.
    #[allow(unsafe_code)]
    unsafe {
        Copier::new(b.spans(), vec![g]).unwrap()
    }
}

#[test]
fn strided_rows_round_trip_over_threads() {
    let mut b = Bufs::new(3000, 3000);
    let c = strided(&mut b);
    let n = c
        .copy(Direction::Store, &[runs(0, &[0, 2], &[4, 1], &[1, 1])], 2)
        .unwrap();
    assert_eq!(n, 1000);
    assert_eq!(&b.cpu[2400..2900], &b.gpu[0..500]);
    assert_eq!(&b.cpu[600..1100], &b.gpu[2000..2500]);
    assert!(b.cpu[..600].iter().all(|x| *x == 0));
    assert!(b.cpu[2900..].iter().all(|x| *x == 0));
    b.gpu.fill(0);
    c.copy(Direction::Load, &[runs(0, &[1], &[4], &[1])], 1)
        .unwrap();
    assert_eq!(&b.gpu[1000..1500], &b.cpu[2400..2900]);
    assert!(b.gpu[1500..].iter().all(|x| *x == 0));
}

#[test]
fn rows_outside_the_registration_copy_nothing() {
    let mut b = Bufs::new(3000, 3000);
    let c = strided(&mut b);
    for (g0, c0, n) in [(2, 0, 2), (0, 4, 2), (-1, 0, 1), (0, -1, 1), (0, 0, -1)] {
        let bad = [runs(0, &[0], &[0], &[1]), runs(0, &[g0], &[c0], &[n])];
        let e = c.copy(Direction::Store, &bad, 1).unwrap_err();
        assert!(matches!(e, CopyError::RowsOutOfRange { run: 1, .. }), "{e}");
    }
    let e = c
        .copy(
            Direction::Store,
            &[runs(0, &[i64::MAX], &[0], &[i64::MAX])],
            1,
        )
        .unwrap_err();
    assert!(e.to_string().contains(&i64::MAX.to_string()), "{e}");
    let e = c
        .copy(Direction::Load, &[runs(1, &[0], &[0], &[1])], 1)
        .unwrap_err();
    assert_eq!(e.to_string(), "run 0: group 1 is not registered (1 groups)");
    let e = c
        .copy(Direction::Load, &[runs(0, &[0, 1], &[0], &[1])], 1)
        .unwrap_err();
    assert!(matches!(e, CopyError::Lengths { .. }));
    let mut one = runs(0, &[0], &[0], &[1]);
    one.region = Some(1);
    assert!(matches!(
        c.copy(Direction::Load, &[one], 1),
        Err(CopyError::UnknownRegion { .. })
    ));
    assert!(
        b.cpu.iter().all(|x| *x == 0),
        "a rejected call copied bytes"
    );
}

#[test]
fn registration_rejects_rows_past_their_buffer_and_overlapping_sides() {
    let mut b = Bufs::new(3000, 3000);
    let spans = b.spans();
    let mk = |gpu: RowSpace, cpu: RowSpace, row_bytes: usize| Group {
        gpu_rows: 3,
        cpu_rows: 5,
        regions: vec![Region {
            gpu,
            cpu,
            row_bytes,
        }],
    };
    let cases = [
        mk(space(0, 1, 1000), space(1, 0, 600), 500), // GPU end 2501 ok, CPU ok
        mk(space(0, 0, 1000), space(1, 1, 600), 500), // CPU ends at 2901: ok
        mk(space(0, 0, 1000), space(1, 401, 600), 500), // CPU ends at 3001 > 3000
        mk(space(0, 0, 400), space(1, 0, 600), 500),  // GPU rows overlap
        mk(space(0, 0, 1000), space(2, 0, 600), 500), // unknown buffer
        mk(space(0, 0, 1000), space(0, 1500, 100), 100), // CPU rows among the GPU rows
        mk(space(0, 0, usize::MAX), space(1, 0, 600), 500), // overflow
    ];
    let ok: Vec<bool> = cases
        .iter()
        .map(|g| {
            // SAFETY: the buffers outlive the (dropped at once) copier.
            #[allow(unsafe_code)]
            unsafe {
                Copier::new(spans.clone(), vec![g.clone()]).is_ok()
            }
        })
        .collect();
    assert_eq!(ok, [true, true, false, false, false, false, false]);
}

#[test]
fn contiguous_rows_merge_and_split_at_piece_size() {
    let rows = 600;
    let mut b = Bufs::new(rows << 10, rows << 10);
    let g = Group {
        gpu_rows: rows,
        cpu_rows: rows,
        regions: vec![Region {
            gpu: space(0, 0, 1 << 10),
            cpu: space(1, 0, 1 << 10),
            row_bytes: 1 << 10,
        }],
    };
    // SAFETY: the buffers outlive the copier.
    #[allow(unsafe_code)]
    let c = unsafe { Copier::new(b.spans(), vec![g]).unwrap() };
    let t = [runs(0, &[0], &[0], &[rows as i64])];
    let ps = c.pieces(Direction::Store, &t).unwrap();
    assert_eq!(ps.len(), (rows << 10).div_ceil(PIECE));
    assert_eq!(c.copy(Direction::Store, &t, 3).unwrap(), rows << 10);
    assert_eq!(b.cpu, b.gpu);
}

#[test]
fn a_destination_written_twice_is_copied_in_order() {
    let mut b = Bufs::new(3000, 3000);
    let c = strided(&mut b);
    // CPU row 0 is written from GPU row 0, then from GPU row 2: the last one wins.
    let t = [runs(0, &[0, 2], &[0, 0], &[1, 1])];
    c.copy(Direction::Store, &t, 4).unwrap();
    assert_eq!(&b.cpu[..500], &b.gpu[2000..2500]);
}

#[test]
fn packed_rows_copy_in_place_and_a_bad_row_copies_nothing() {
    let mut b = Bufs::new(3000, 3000);
    let c = strided(&mut b);
    let mut buf = Vec::new();
    for (job, gpu, cpu, len) in [(0, 0, 4, 1), (1, 1, 0, 2), (1, 2, 2, 9)] {
        let group = 0;
        runs::push(
            &mut buf,
            runs::Run {
                job,
                group,
                gpu,
                cpu,
                len,
            },
        );
    }
    // Rows 0..2 only: the third row (out of range) is not read.
    assert_eq!(
        c.copy_packed(Direction::Store, &buf, 0..2, None, 2)
            .unwrap(),
        1500
    );
    assert_eq!(&b.cpu[2400..2900], &b.gpu[0..500]);
    assert_eq!(&b.cpu[0..500], &b.gpu[1000..1500]);
    assert_eq!(&b.cpu[600..1100], &b.gpu[2000..2500]);
    let before = b.cpu.clone();
    b.gpu.fill(9);
    let e = c
        .copy_packed(Direction::Store, &buf, 0..3, None, 1)
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("run 2 (group 0): GPU rows 2..2+9"),
        "{e}"
    );
    assert!(c
        .copy_packed(Direction::Store, &buf, 2..4, None, 1)
        .is_err());
    assert!(c
        .copy_packed(Direction::Store, &buf[..7], 0..0, None, 1)
        .is_err());
    // Rows past the end of a buffer whose rows are all good: refused, not read.
    let e = c
        .copy_packed(Direction::Store, &buf[..2 * runs::RUN_BYTES], 1..3, None, 1)
        .unwrap_err();
    assert_eq!(
        e,
        CopyError::Packed {
            reason: "rows 1..3 of a buffer of 2 rows".into()
        }
    );
    assert_eq!(b.cpu, before, "a rejected call copied bytes");
    assert_eq!(
        c.copy_packed(Direction::Load, &buf, 1..1, None, 1).unwrap(),
        0
    );
}
