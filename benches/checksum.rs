//! Chunk checksum benchmark: CRC-32C (the header's checksum) of one 2 MiB chunk.
//!
//! Run with `cargo bench --bench checksum`; criterion's throughput line gives GB/s. Two
//! implementations of the same function on the same bytes:
//! - `crc32c`: the `crc32c` crate (SSE 4.2 `crc32` instruction, three streams).
//! - `crc_fast`: the `crc-fast` crate (carry-less multiply folding; VPCLMULQDQ only with
//!   AVX-512), the path it picked printed first.
//!
//! Measured (session 8, 2-core AMD EPYC without AVX-512, loaded by other builds; runs of
//! `cargo bench --bench checksum -- --warm-up-time 1 --measurement-time 3`): `crc32c` 8.8 and
//! 8.0 GiB/s, `crc_fast` 1.9.0 (path `x86-sse-pclmulqdq`) 6.0 and 5.5 GiB/s; `crc_fast` 1.10.0
//! the same (12.5 and 9.0 against 6.1 and 6.0 GiB/s). The chunk checksum stays on `crc32c`.
//! `crc-fast`'s README reports 54-111 GiB/s at 1 MiB with AVX-512 VPCLMULQDQ (Genoa, Sapphire
//! Rapids): this bench is the check to rerun on such a machine before switching (the values
//! must stay those of `tier::header`'s known-vector test).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn bench(c: &mut Criterion) {
    let len = 2 << 20;
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let data: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    assert_eq!(
        crc32c::crc32c(&data),
        crc_fast::crc32_iscsi(&data),
        "the two implementations disagree"
    );
    eprintln!(
        "crc-fast path: {}",
        crc_fast::get_calculator_target(crc_fast::CrcAlgorithm::Crc32Iscsi)
    );
    let mut g = c.benchmark_group("checksum_2mib");
    g.throughput(Throughput::Bytes(len as u64));
    g.bench_function("crc32c", |b| b.iter(|| crc32c::crc32c(black_box(&data))));
    g.bench_function("crc_fast", |b| {
        b.iter(|| crc_fast::crc32_iscsi(black_box(&data)));
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
