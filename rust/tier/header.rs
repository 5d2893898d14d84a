//! The header every chunk carries below the CPU pool (DESIGN.md §9), shared by every lower tier
//! (disk slots, Redis values).
//!
//! A header is [`HEADER_LEN`] bytes, little-endian, at a fixed place next to its chunk's data:
//!
//! | bytes | field | meaning |
//! |---|---|---|
//! | 0..8 | magic | [`MAGIC`] |
//! | 8..12 | version | [`VERSION`]; any other value is not ours to read |
//! | 12..16 | group | the chunk's KV group |
//! | 16..32 | namespace | [`Namespace`](super::namespace::Namespace) digest of the writer |
//! | 32..48 | key | the chunk's [`Key`] |
//! | 48..56 | length | data bytes that follow |
//! | 56..64 | generation | the writer's monotonic write counter; the newest copy of a key wins |
//! | 64..68 | checksum | CRC-32C of the `length` data bytes |
//! | 68..72 | header checksum | CRC-32C of bytes 0..68, so a flipped header bit is caught too |
//!
//! The contract of a writer (the *two-phase publish*): the data is written and made durable
//! first, the header after it. A reader trusts a chunk only when [`ChunkHeader::decode`]
//! accepts the header, every field equals what the reader expected (namespace, key, group,
//! length, and the generation its index holds) and [`checksum`] of the data equals the header's
//! checksum. Anything else is a miss, counted, and never served. An all-zero header means "no
//! chunk" (a free or invalidated place): it never decodes.

use crate::ids::Key;

/// First bytes of every header.
pub const MAGIC: [u8; 8] = *b"KVOFFLD\x01";
/// The header format this build writes and reads.
pub const VERSION: u32 = 1;
/// Encoded size of a header in bytes.
pub const HEADER_LEN: usize = 72;

/// The fields of one chunk header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkHeader {
    /// KV group of the chunk.
    pub group: u32,
    /// Namespace digest of the writer.
    pub namespace: u128,
    /// The chunk's key.
    pub key: Key,
    /// Data bytes.
    pub length: u64,
    /// Monotonic write counter of the writer.
    pub generation: u64,
    /// CRC-32C of the data ([`checksum`]).
    pub checksum: u32,
}

/// Why a header was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// Fewer than [`HEADER_LEN`] bytes.
    #[error("header truncated: {0} bytes, need {HEADER_LEN}")]
    Truncated(usize),
    /// Every byte zero: no chunk was ever committed here (or it was invalidated).
    #[error("no chunk committed (empty header)")]
    Empty,
    /// Not our magic.
    #[error("bad magic")]
    Magic,
    /// Our magic, another format version.
    #[error("format version {0}, this build reads {VERSION}")]
    Version(u32),
    /// The header's own checksum does not match its bytes.
    #[error("header checksum mismatch")]
    HeaderChecksum,
}

/// CRC-32C of a chunk's data given as pieces, in order (the same value as of their
/// concatenation).
pub fn checksum<'a>(pieces: impl IntoIterator<Item = &'a [u8]>) -> u32 {
    pieces.into_iter().fold(0, crc32c::crc32c_append)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u128_at(b: &[u8], at: usize) -> u128 {
    u128::from_le_bytes(b[at..at + 16].try_into().expect("16 bytes"))
}

impl ChunkHeader {
    /// The encoded header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.group.to_le_bytes());
        b[16..32].copy_from_slice(&self.namespace.to_le_bytes());
        b[32..48].copy_from_slice(&self.key.0.to_le_bytes());
        b[48..56].copy_from_slice(&self.length.to_le_bytes());
        b[56..64].copy_from_slice(&self.generation.to_le_bytes());
        b[64..68].copy_from_slice(&self.checksum.to_le_bytes());
        let own = crc32c::crc32c(&b[..68]);
        b[68..72].copy_from_slice(&own.to_le_bytes());
        b
    }

    /// Decodes the first [`HEADER_LEN`] bytes of `b`; refuses anything that is not a committed
    /// header of this format. Field values are the caller's to compare.
    pub fn decode(b: &[u8]) -> Result<Self, HeaderError> {
        if b.len() < HEADER_LEN {
            return Err(HeaderError::Truncated(b.len()));
        }
        let b = &b[..HEADER_LEN];
        if b.iter().all(|&x| x == 0) {
            return Err(HeaderError::Empty);
        }
        if b[0..8] != MAGIC {
            return Err(HeaderError::Magic);
        }
        let version = u32_at(b, 8);
        if version != VERSION {
            return Err(HeaderError::Version(version));
        }
        if crc32c::crc32c(&b[..68]) != u32_at(b, 68) {
            return Err(HeaderError::HeaderChecksum);
        }
        Ok(Self {
            group: u32_at(b, 12),
            namespace: u128_at(b, 16),
            key: Key(u128_at(b, 32)),
            length: u64_at(b, 48),
            generation: u64_at(b, 56),
            checksum: u32_at(b, 64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ChunkHeader {
        ChunkHeader {
            group: 3,
            namespace: 0x0123_4567_89ab_cdef_0011_2233_4455_6677,
            key: Key(u128::MAX - 5),
            length: 2 << 20,
            generation: 42,
            checksum: checksum([&b"abc"[..], b"def"]),
        }
    }

    #[test]
    fn round_trip() {
        let h = sample();
        assert_eq!(ChunkHeader::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn checksum_of_pieces_is_checksum_of_concatenation() {
        assert_eq!(checksum([&b"abc"[..], b"def"]), crc32c::crc32c(b"abcdef"));
        assert_ne!(checksum([&b"abd"[..], b"def"]), crc32c::crc32c(b"abcdef"));
    }

    #[test]
    fn checksum_is_crc32c_on_known_vectors() {
        // The format's checksum (CRC-32C, Castagnoli): RFC 3720 B.4 vectors and the catalogue's
        // check value; any change of implementation must keep these.
        assert_eq!(checksum([&b"123456789"[..]]), 0xE306_9283);
        assert_eq!(checksum([&[0u8; 32][..]]), 0x8A91_36AA);
        assert_eq!(checksum([&[0xFFu8; 32][..]]), 0x62A8_AB43);
        let inc: Vec<u8> = (0..32).collect();
        assert_eq!(checksum([&inc[..]]), 0x46DD_794E);
        assert_eq!(checksum([&inc[..7], &inc[7..]]), 0x46DD_794E);
        assert_eq!(checksum([]), 0);
    }

    #[test]
    fn every_single_bit_flip_is_refused() {
        let enc = sample().encode();
        for bit in 0..HEADER_LEN * 8 {
            let mut b = enc;
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(
                ChunkHeader::decode(&b).is_err(),
                "bit {bit} flipped, accepted"
            );
        }
    }

    #[test]
    fn empty_truncated_and_foreign_headers_are_refused() {
        assert_eq!(
            ChunkHeader::decode(&[0u8; HEADER_LEN]),
            Err(HeaderError::Empty)
        );
        assert_eq!(
            ChunkHeader::decode(&sample().encode()[..10]),
            Err(HeaderError::Truncated(10))
        );
        let mut b = sample().encode();
        b[8] = 2;
        assert_eq!(ChunkHeader::decode(&b), Err(HeaderError::Version(2)));
        b[0] = b'X';
        assert_eq!(ChunkHeader::decode(&b), Err(HeaderError::Magic));
    }
}
