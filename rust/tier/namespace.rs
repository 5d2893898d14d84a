//! Namespaces: which chunks below the CPU pool a process may read (DESIGN.md §9).
//!
//! Two processes may share a lower tier only when their bytes mean the same thing. A
//! [`Namespace`] names everything that fixes the meaning of a chunk's bytes: the model, the KV
//! layout (dtype, per-tensor shapes of one chunk, block size, blocks per chunk), the tensor
//! parallel rank and world size, the KV group, and an optional tenant `cache_salt`. Its
//! [`Namespace::digest`] is a 128-bit FNV-1a hash of a canonical, length-prefixed encoding of
//! those fields (stable across builds and platforms).
//!
//! An engine has two namespaces per group and rank. Its *place* (`disk::engine_namespace`)
//! holds what the scheduler knows from its configuration (the chunk's size as one tensor) and
//! names where chunks go: the directory on disk ([`Namespace::dir_name`]), the shared tier's
//! keys. Its *layout* (`disk::layout_namespace`) is the worker's: the same fields with the
//! element type and the bytes of each registered tensor; it is written into every chunk header
//! (and the disk directory's layout note, where the scheduler reads it back). A reader compares
//! the digest of every header it reads with its own layout's: engines with different layouts,
//! ranks or tenants never read each other's bytes.
//!
//! Engines that already mix the tenant salt into their block hashes (vLLM does) may leave
//! `cache_salt` empty: their keys differ anyway.

use crate::ids::Key;

/// Everything that fixes the meaning of a chunk's bytes. See the module documentation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Namespace {
    /// Model identity (name and revision, or any string the engine trusts to name the weights).
    pub model: String,
    /// Element type of the KV tensors, e.g. `"bfloat16"`.
    pub dtype: String,
    /// Per registered tensor of the group, the shape of one chunk of it.
    pub tensor_shapes: Vec<Vec<u64>>,
    /// Tokens per GPU block.
    pub block_size: u32,
    /// GPU blocks per chunk.
    pub blocks_per_chunk: u32,
    /// Tensor parallel rank of the writer.
    pub rank: u32,
    /// Tensor parallel world size.
    pub world_size: u32,
    /// KV group index.
    pub group: u32,
    /// Optional tenant salt.
    pub cache_salt: String,
}

impl Namespace {
    /// This namespace for tenant `cache_salt` (the shared tier's: tenants share nothing).
    #[must_use]
    pub fn salted(self, cache_salt: &str) -> Self {
        Self {
            cache_salt: cache_salt.to_owned(),
            ..self
        }
    }

    /// The 128-bit digest written into every header of this namespace.
    pub fn digest(&self) -> u128 {
        let mut enc: Vec<u8> = b"kvoffload-namespace-v1".to_vec();
        let mut field = |tag: u8, bytes: &[u8]| {
            enc.push(tag);
            enc.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            enc.extend_from_slice(bytes);
        };
        field(1, self.model.as_bytes());
        field(2, self.dtype.as_bytes());
        let mut shapes = Vec::new();
        for shape in &self.tensor_shapes {
            shapes.extend_from_slice(&(shape.len() as u64).to_le_bytes());
            for d in shape {
                shapes.extend_from_slice(&d.to_le_bytes());
            }
        }
        field(3, &shapes);
        field(4, &self.block_size.to_le_bytes());
        field(5, &self.blocks_per_chunk.to_le_bytes());
        field(6, &self.rank.to_le_bytes());
        field(7, &self.world_size.to_le_bytes());
        field(8, &self.group.to_le_bytes());
        field(9, self.cache_salt.as_bytes());
        // The encoding is always longer than 16 bytes, so this is FNV-1a over all of it.
        Key::from_bytes(&enc).0
    }

    /// The directory name of this namespace: its digest in 32 hex digits.
    pub fn dir_name(&self) -> String {
        format!("{:032x}", self.digest())
    }

    /// The same namespace for another tensor parallel rank.
    #[must_use]
    pub fn for_rank(&self, rank: u32) -> Self {
        Self {
            rank,
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Namespace {
        Namespace {
            model: "m".into(),
            dtype: "bfloat16".into(),
            tensor_shapes: vec![vec![2, 16, 8, 128]; 4],
            block_size: 16,
            blocks_per_chunk: 1,
            rank: 0,
            world_size: 2,
            group: 0,
            cache_salt: String::new(),
        }
    }

    #[test]
    fn every_field_changes_the_digest() {
        let d = base().digest();
        let variants = [
            Namespace {
                model: "m2".into(),
                ..base()
            },
            Namespace {
                dtype: "float16".into(),
                ..base()
            },
            Namespace {
                tensor_shapes: vec![vec![2, 16, 8, 64]; 4],
                ..base()
            },
            Namespace {
                tensor_shapes: vec![vec![2, 16, 8, 128]; 3],
                ..base()
            },
            Namespace {
                block_size: 32,
                ..base()
            },
            Namespace {
                blocks_per_chunk: 2,
                ..base()
            },
            Namespace {
                world_size: 4,
                ..base()
            },
            Namespace { group: 1, ..base() },
            Namespace {
                cache_salt: "tenant".into(),
                ..base()
            },
            base().for_rank(1),
        ];
        for v in variants {
            assert_ne!(v.digest(), d, "{v:?}");
        }
        assert_eq!(base().digest(), d, "deterministic");
    }

    #[test]
    fn fields_do_not_bleed_into_each_other() {
        // Length prefixes: moving a byte from one string field to the next changes the digest.
        let a = Namespace {
            model: "ab".into(),
            dtype: "c".into(),
            ..base()
        };
        let b = Namespace {
            model: "a".into(),
            dtype: "bc".into(),
            ..base()
        };
        assert_ne!(a.digest(), b.digest());
        assert_eq!(base().dir_name().len(), 32);
    }
}
