//! The floor of `benches/disk_stall.py`: the bytes the disk tier moves, moved by a plain
//! positioned write / read loop in a process of its own (no GIL, none of the tier's code), so
//! that what moving them costs the engine's thread on this machine can be told apart from what
//! the tier adds.
//!
//! Usage: `disk_floor PATH SLOTS DIRECT` (`DIRECT`: 1 for `O_DIRECT`, as the tier chose). The
//! file holds `SLOTS` slots laid out as the tier's slab: a 4 KiB header block, then 2 MiB of
//! data. Commands on standard input, one a line, one answer a line on standard output:
//!
//! * `w FIRST COUNT`: for each slot, the CRC-32C of its data, then its zeroed header block and
//!   its data in one positioned write; one `fdatasync` for the lot; then each header block (the
//!   checksum in its first 4 bytes) through the page cache. Answers `ok`.
//! * `r FIRST COUNT`: each slot's header block and data in one positioned read, its data's
//!   CRC-32C checked against the header's. Answers `ok`, or `bad SLOT` on a mismatch.
//!
//! It prints `ready` once the file is open and the buffer filled, and ends at end of input.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};

const HEADER: usize = 4096;
const CHUNK: usize = 2 << 20;
const SLOT: usize = HEADER + CHUNK;

/// The slab file (the data descriptor is `O_DIRECT` when asked) and a page-aligned buffer of
/// every slot.
struct Floor {
    data: File,
    headers: File,
    mem: Vec<u8>,
    start: usize,
}

impl Floor {
    fn open(path: &str, slots: usize, direct: bool) -> io::Result<Self> {
        let headers = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        headers.set_len((slots * SLOT) as u64)?;
        let mut data = OpenOptions::new();
        data.read(true).write(true);
        if direct {
            data.custom_flags(libc::O_DIRECT);
        }
        let data = data.open(path)?;
        let mut mem = vec![0u8; slots * SLOT + HEADER];
        let start = (HEADER - mem.as_ptr() as usize % HEADER) % HEADER;
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for b in &mut mem {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        Ok(Self {
            data,
            headers,
            mem,
            start,
        })
    }

    fn slot(&mut self, i: usize) -> &mut [u8] {
        let at = self.start + i * SLOT;
        &mut self.mem[at..at + SLOT]
    }

    fn write(&mut self, slots: std::ops::Range<usize>) -> io::Result<()> {
        let mut crcs = Vec::with_capacity(slots.len());
        for i in slots.clone() {
            let s = self.slot(i);
            crcs.push(crc32c::crc32c(&s[HEADER..]));
            s[..HEADER].fill(0);
            let s = &self.mem[self.start + i * SLOT..self.start + (i + 1) * SLOT];
            self.data.write_all_at(s, (i * SLOT) as u64)?;
        }
        self.data.sync_data()?;
        let mut block = vec![0u8; HEADER];
        for (i, crc) in slots.zip(crcs) {
            block[..4].copy_from_slice(&crc.to_le_bytes());
            self.headers.write_all_at(&block, (i * SLOT) as u64)?;
        }
        Ok(())
    }

    /// The first slot whose data does not match its header's checksum, if any.
    fn read(&mut self, slots: std::ops::Range<usize>) -> io::Result<Option<usize>> {
        let mut bad = None;
        for i in slots {
            let at = self.start + i * SLOT;
            self.data
                .read_exact_at(&mut self.mem[at..at + SLOT], (i * SLOT) as u64)?;
            let s = &self.mem[at..at + SLOT];
            let want = u32::from_le_bytes(s[..4].try_into().expect("4 bytes"));
            if crc32c::crc32c(&s[HEADER..]) != want && bad.is_none() {
                bad = Some(i);
            }
        }
        Ok(bad)
    }
}

fn parse(line: &str, slots: usize) -> Result<(bool, std::ops::Range<usize>), String> {
    let mut it = line.split_whitespace();
    let write = match it.next() {
        Some("w") => true,
        Some("r") => false,
        _ => return Err(format!("unknown command {line:?}")),
    };
    let mut num = || -> Result<usize, String> {
        it.next()
            .and_then(|x| x.parse().ok())
            .ok_or_else(|| format!("bad numbers in {line:?}"))
    };
    let (first, count) = (num()?, num()?);
    match first.checked_add(count) {
        Some(end) if end <= slots => Ok((write, first..end)),
        _ => Err(format!("slots {first} + {count} outside 0..{slots}")),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        return Err("usage: disk_floor PATH SLOTS DIRECT".into());
    }
    let slots: usize = args[2].parse()?;
    let mut floor = Floor::open(&args[1], slots, args[3] == "1")?;
    let mut out = io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    for line in io::stdin().lock().lines() {
        let (write, range) = parse(&line?, slots)?;
        if write {
            floor.write(range)?;
            writeln!(out, "ok")?;
        } else {
            match floor.read(range)? {
                None => writeln!(out, "ok")?,
                Some(i) => writeln!(out, "bad {i}")?,
            }
        }
        out.flush()?;
    }
    Ok(())
}
