//! A layout's fields by name: what `rubyspy layout` prints, what a table and a target's own
//! debug information are compared by, and how a layout read from debug information is
//! built and cached (core/src/dwarf/). `layout_struct!` declares `Layout` (lib.rs) and its
//! named access together, so a field cannot be added without it.

use std::fmt;

/// One field's value, whatever its Rust type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldValue {
    /// An offset, size or constant.
    Num(u64),
    /// An `Option` that is None: the Ruby has no such field.
    Absent,
    /// (byte offset, mask) of a bitfield, or (offset, offset) of a pair.
    Pair(u64, u64),
}

impl fmt::Display for FieldValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FieldValue::Num(n) => write!(f, "{n}"),
            FieldValue::Absent => write!(f, "none"),
            FieldValue::Pair(a, b) => write!(f, "({a}, {b})"),
        }
    }
}

impl FieldValue {
    /// The value [`Display`](fmt::Display) wrote (the layout cache's text).
    pub fn parse(text: &str) -> Option<FieldValue> {
        if text == "none" {
            return Some(FieldValue::Absent);
        }
        if let Some(pair) = text.strip_prefix('(').and_then(|t| t.strip_suffix(')')) {
            let (a, b) = pair.split_once(", ")?;
            return Some(FieldValue::Pair(a.parse().ok()?, b.parse().ok()?));
        }
        text.parse().ok().map(FieldValue::Num)
    }
}

/// A Rust type a layout field has.
pub trait Field: Sized {
    fn value(&self) -> FieldValue;
    /// None when `value` does not fit the type (a number too wide, a pair for a number).
    fn from_value(value: FieldValue) -> Option<Self>;
}

macro_rules! number_field {
    ($($t:ty),*) => {$(
        impl Field for $t {
            fn value(&self) -> FieldValue {
                FieldValue::Num(*self as u64)
            }
            fn from_value(value: FieldValue) -> Option<Self> {
                match value {
                    FieldValue::Num(n) => <$t>::try_from(n).ok(),
                    _ => None,
                }
            }
        }
        impl Field for Option<$t> {
            fn value(&self) -> FieldValue {
                self.map_or(FieldValue::Absent, |n| FieldValue::Num(n as u64))
            }
            fn from_value(value: FieldValue) -> Option<Self> {
                match value {
                    FieldValue::Absent => Some(None),
                    FieldValue::Num(n) => <$t>::try_from(n).ok().map(Some),
                    FieldValue::Pair(..) => None,
                }
            }
        }
    )*};
}
number_field!(usize, u32, u64);

macro_rules! pair_field {
    ($($b:ty),*) => {$(
        impl Field for Option<(usize, $b)> {
            fn value(&self) -> FieldValue {
                self.map_or(FieldValue::Absent, |(a, b)| FieldValue::Pair(a as u64, b as u64))
            }
            fn from_value(value: FieldValue) -> Option<Self> {
                match value {
                    FieldValue::Absent => Some(None),
                    FieldValue::Pair(a, b) => Some(Some((usize::try_from(a).ok()?, <$b>::try_from(b).ok()?))),
                    FieldValue::Num(_) => None,
                }
            }
        }
    )*};
}
pair_field!(u8, usize);

impl Field for (usize, u8) {
    fn value(&self) -> FieldValue {
        FieldValue::Pair(self.0 as u64, self.1 as u64)
    }
    fn from_value(value: FieldValue) -> Option<Self> {
        match value {
            FieldValue::Pair(a, b) => Some((usize::try_from(a).ok()?, u8::try_from(b).ok()?)),
            _ => None,
        }
    }
}

/// Declares `Layout` with its `name` and its other fields, and `Layout::FIELDS`,
/// `Layout::fields` and `Layout::from_fields` over those others.
macro_rules! layout_struct {
    (
        $(#[$meta:meta])*
        pub struct Layout {
            $(#[$name_meta:meta])*
            pub name: &'static str,
            $( $(#[$field_meta:meta])* pub $field:ident : $t:ty, )*
        }
    ) => {
        $(#[$meta])*
        pub struct Layout {
            $(#[$name_meta])*
            pub name: &'static str,
            $( $(#[$field_meta])* pub $field: $t, )*
        }

        impl Layout {
            /// Every field but `name`, in declaration order.
            pub const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];

            /// Every field but `name`, with its value.
            pub fn fields(&self) -> Vec<(&'static str, $crate::fields::FieldValue)> {
                vec![$((stringify!($field), $crate::fields::Field::value(&self.$field))),*]
            }

            /// A layout named `name` whose fields `value` gives (by name), or the first
            /// field it has no value for, or one that does not fit the field's type.
            pub fn from_fields<E>(
                name: &'static str,
                mut value: impl FnMut(&'static str) -> Result<$crate::fields::FieldValue, E>,
                misfit: impl Fn(&'static str, $crate::fields::FieldValue) -> E,
            ) -> Result<Layout, E> {
                Ok(Layout {
                    name,
                    $($field: {
                        let v = value(stringify!($field))?;
                        $crate::fields::Field::from_value(v).ok_or_else(|| misfit(stringify!($field), v))?
                    },)*
                })
            }
        }
    };
}
pub(crate) use layout_struct;
