//! How one pipeline's commands are laid out in the Redis protocol: the framing packed
//! together, data pieces sent from the caller's memory (no copy), and where a pipeline may be
//! split so that the server takes its last large value without copying it.

use std::borrow::Cow;

/// Pieces at least this long are sent from where they are (one more `iovec` of a `writev`)
/// instead of being copied into the framing.
const SEND_IN_PLACE: usize = 4 << 10;

/// Values at least this long are a large argument for the server: it reads them into a buffer
/// of their own, without a copy, when that buffer starts with the value (Redis's
/// `PROTO_MBULK_BIG_ARG`, 32 KiB).
pub(super) const BIG_ARG: usize = 32 << 10;

/// Bytes to send, in order: owned framing and borrowed data pieces.
pub(super) type Segments<'a> = Vec<Cow<'a, [u8]>>;

/// A pipeline split before its last large value (see [`Packed::finish_split`]).
pub(super) struct Split<'a> {
    /// Every byte before the last large value (its length line included).
    pub lead: Segments<'a>,
    /// The rest.
    pub tail: Segments<'a>,
    /// Commands in the pipeline (replies to read).
    pub commands: usize,
}

/// Commands of one pipeline in the Redis protocol, as segments to send in order: the framing
/// and small pieces are packed together, data pieces are sent from the caller's memory.
#[derive(Default)]
pub(super) struct Packed<'a> {
    segments: Segments<'a>,
    small: Vec<u8>,
    commands: usize,
    /// Segments before the last large value's first byte (after its length line).
    split: usize,
}

impl<'a> Packed<'a> {
    /// Appends one command: `args` (copied), then, when given, a last argument made of a
    /// prefix (copied) and data pieces (sent from where they are when large).
    pub(super) fn command(&mut self, args: &[&[u8]], value: Option<(&[u8], &[&'a [u8]])>) {
        let count = args.len() + usize::from(value.is_some());
        self.small
            .extend_from_slice(format!("*{count}\r\n").as_bytes());
        for arg in args {
            self.small
                .extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
            self.small.extend_from_slice(arg);
            self.small.extend_from_slice(b"\r\n");
        }
        if let Some((prefix, pieces)) = value {
            let len = prefix.len() + pieces.iter().map(|p| p.len()).sum::<usize>();
            self.small
                .extend_from_slice(format!("${len}\r\n").as_bytes());
            if len >= BIG_ARG {
                self.flush();
                self.split = self.segments.len();
            }
            self.small.extend_from_slice(prefix);
            for &p in pieces {
                if p.len() >= SEND_IN_PLACE {
                    self.flush();
                    self.segments.push(p.into());
                } else {
                    self.small.extend_from_slice(p);
                }
            }
            self.small.extend_from_slice(b"\r\n");
        }
        self.commands += 1;
    }

    fn flush(&mut self) {
        if !self.small.is_empty() {
            self.segments.push(std::mem::take(&mut self.small).into());
        }
    }

    /// The segments, ready to send, and the number of commands.
    pub(super) fn finish(self) -> (Segments<'a>, usize) {
        let Split {
            mut lead,
            tail,
            commands,
        } = self.finish_split();
        lead.extend(tail);
        (lead, commands)
    }

    /// The segments split in two: the *lead*, every byte before the last large value (its
    /// length line included), and the *tail*, the rest. Without a large value the lead is
    /// everything.
    ///
    /// Why: the server reads as much as its buffer takes. When the lead arrived alone, it
    /// reads the large value's bytes into a buffer of their own and keeps that buffer as the
    /// value; when the value's first bytes arrived in the same read as the command before it,
    /// it moves them and copies the rest (measured: the whole 2 MiB value in most reads).
    /// Sending the lead of the next pipeline after the tail of the current one, and its tail
    /// only after the current replies came back, makes the lead arrive alone.
    pub(super) fn finish_split(mut self) -> Split<'a> {
        self.flush();
        let tail = if self.split > 0 {
            self.segments.split_off(self.split)
        } else {
            Vec::new()
        };
        Split {
            lead: self.segments,
            tail,
            commands: self.commands,
        }
    }
}

/// Pieces of `data` covering bytes `start..end` of their concatenation.
pub(super) fn slice_pieces<'a>(data: &[&'a [u8]], start: usize, end: usize) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let mut at = 0;
    for p in data {
        let (lo, hi) = (at, at + p.len());
        at = hi;
        if hi <= start || lo >= end {
            continue;
        }
        out.push(&p[start.max(lo) - lo..end.min(hi) - lo]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(segments: &[Cow<'_, [u8]>]) -> Vec<u8> {
        segments.concat()
    }

    fn fill<'a>(p: &mut Packed<'a>, big: &'a [u8], small: &'a [u8]) {
        p.command(&[b"SET", b"k1"], Some((b"", &[small])));
        p.command(&[b"SET", b"k2"], Some((b"", &[big])));
        p.command(&[b"SET", b"k3"], Some((b"hd", &[big, small])));
    }

    #[test]
    fn the_lead_ends_at_the_last_large_value() {
        let big = vec![7u8; BIG_ARG];
        let small = [1u8; 10];
        let mut p = Packed::default();
        fill(&mut p, &big, &small);
        let whole = bytes(&p.finish().0);
        let mut expect = Vec::new();
        for (k, v) in [
            (&b"k1"[..], small.to_vec()),
            (b"k2", big.clone()),
            (b"k3", [&b"hd"[..], &big, &small].concat()),
        ] {
            expect.extend_from_slice(b"*3\r\n$3\r\nSET\r\n$2\r\n");
            expect.extend_from_slice(k);
            expect.extend_from_slice(format!("\r\n${}\r\n", v.len()).as_bytes());
            expect.extend_from_slice(&v);
            expect.extend_from_slice(b"\r\n");
        }
        assert_eq!(whole, expect);
        let mut p = Packed::default();
        fill(&mut p, &big, &small);
        let Split {
            lead,
            tail,
            commands,
        } = p.finish_split();
        assert_eq!(commands, 3);
        let lead = bytes(&lead);
        let suffix = format!("${}\r\n", BIG_ARG + 12);
        assert!(
            lead.ends_with(suffix.as_bytes()),
            "{:?}",
            &lead[lead.len() - 20..]
        );
        assert_eq!([lead, bytes(&tail)].concat(), whole);
        // Large pieces are sent from the caller's memory.
        assert!(tail
            .iter()
            .any(|s| matches!(s, Cow::Borrowed(b) if b.as_ptr() == big.as_ptr())));
    }

    #[test]
    fn without_a_large_value_the_lead_is_everything() {
        let mut p = Packed::default();
        p.command(&[b"EXISTS", b"k"], None);
        let Split {
            lead,
            tail,
            commands,
        } = p.finish_split();
        assert_eq!(
            (bytes(&lead), tail.len(), commands),
            (b"*2\r\n$6\r\nEXISTS\r\n$1\r\nk\r\n".to_vec(), 0, 1)
        );
    }

    #[test]
    fn pieces_slice() {
        let a: Vec<u8> = (0..10).collect();
        let b: Vec<u8> = (10..25).collect();
        let data = [&a[..], &b[..]];
        let got: Vec<u8> = slice_pieces(&data, 7, 13).concat();
        assert_eq!(got, (7..13).collect::<Vec<u8>>());
        assert_eq!(
            slice_pieces(&data, 0, 25).concat(),
            (0..25).collect::<Vec<u8>>()
        );
        assert!(slice_pieces(&data, 10, 10).concat().is_empty());
    }
}
