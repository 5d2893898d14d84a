//! Cumulative counters shared by a tier's I/O threads: one struct of `AtomicU64` counters and
//! its plain `u64` snapshot, declared together by [`atomic_counters!`] so that each counter is
//! named and documented once and the snapshot cannot miss one.

/// Declares `$name` (one `AtomicU64` per counter, thread-safe, `Default`), `$snap` (the same
/// counters as `u64`), `$name::snapshot`, which reads every counter (relaxed), and
/// `$snap::named`, every counter with its name (for stats dicts), and `$snap::add`.
macro_rules! atomic_counters {
    (
        $(#[$meta:meta])*
        pub struct $name:ident => $(#[$snap_meta:meta])* $snap:ident {
            $( $(#[$field_meta:meta])* $field:ident, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Default)]
        pub struct $name {
            $( $(#[$field_meta])* pub $field: std::sync::atomic::AtomicU64, )*
        }

        $(#[$snap_meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $snap {
            $( $(#[$field_meta])* pub $field: u64, )*
        }

        impl $name {
            /// A copy of every counter.
            pub fn snapshot(&self) -> $snap {
                $snap {
                    $( $field: self.$field.load(std::sync::atomic::Ordering::Relaxed), )*
                }
            }
        }

        impl $snap {
            /// Every counter with its field name, in declaration order.
            pub fn named(&self) -> Vec<(&'static str, u64)> {
                vec![$( (stringify!($field), self.$field), )*]
            }

            /// Adds every counter of `other` (sums over several clients).
            pub fn add(&mut self, other: &$snap) {
                $( self.$field += other.$field; )*
            }
        }
    };
}
pub(crate) use atomic_counters;
