//! How one pipeline's commands are laid out in the Redis protocol: small parts packed
//! together, large data pieces sent from the caller's memory (no copy).

/// Pieces at least this long are sent from where they are instead of being copied.
const SEND_IN_PLACE: usize = 64 << 10;

/// Commands of one pipeline in the Redis protocol, as segments to send in order: small parts
/// are packed together, large data pieces are sent from the caller's memory (no copy).
#[derive(Default)]
pub(super) struct Packed<'a> {
    segments: Vec<std::borrow::Cow<'a, [u8]>>,
    small: Vec<u8>,
    commands: usize,
}

impl<'a> Packed<'a> {
    /// Appends one command; each argument is a list of pieces sent as one bulk string.
    pub(super) fn command(&mut self, args: &[&[&'a [u8]]]) {
        self.small
            .extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for arg in args {
            let len: usize = arg.iter().map(|p| p.len()).sum();
            self.small
                .extend_from_slice(format!("${len}\r\n").as_bytes());
            for &p in *arg {
                if p.len() >= SEND_IN_PLACE {
                    if !self.small.is_empty() {
                        self.segments.push(std::mem::take(&mut self.small).into());
                    }
                    self.segments.push(p.into());
                } else {
                    self.small.extend_from_slice(p);
                }
            }
            self.small.extend_from_slice(b"\r\n");
        }
        self.commands += 1;
    }

    /// The segments, ready to send.
    pub(super) fn finish(mut self) -> (Vec<std::borrow::Cow<'a, [u8]>>, usize) {
        if !self.small.is_empty() {
            self.segments.push(self.small.into());
        }
        (self.segments, self.commands)
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
