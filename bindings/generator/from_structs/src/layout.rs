//! A measured layout as an ordered list of `name: value` fields, printed exactly as
//! `layout_probe.c` prints a `Layout` (so the two can be diffed and `--check`ed as text).
//!
//! This program keeps its own field list instead of building `rbspy_ext_bindings::Layout`:
//! that struct is edited by others, and a text comparison keeps working (and reports the
//! difference) when a field is added there before it is added here.

use std::fmt;

/// One value, in the notation the C probe uses for that field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Val {
    /// `U(...)` in the probe: decimal.
    Dec(u64),
    /// `X(...)`: hexadecimal with `0x`.
    Hex(u64),
    /// `SOME(...)` / `SOMEOFF(...)`.
    Some(u64),
    /// `NONE(...)`.
    None,
    /// `ONE_BIT(...)`: `Some((byte offset, 0xmask))`.
    SomeBit(u64, u8),
}

impl fmt::Display for Val {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Val::Dec(v) => write!(f, "{v}"),
            Val::Hex(v) => write!(f, "{v:#x}"),
            Val::Some(v) => write!(f, "Some({v})"),
            Val::None => write!(f, "None"),
            Val::SomeBit(off, mask) => write!(f, "Some(({off}, {mask:#x}))"),
        }
    }
}

/// Where a value comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// `offset_of!`/`size_of` on a rbspy-ruby-structs type, or one of its generated
    /// constants (possibly combined as the Ruby header combines them, e.g. RSTRING_NOEMBED =
    /// RUBY_FL_USER1). Compared by `--check`.
    Measured,
    /// Not in rbspy-ruby-structs for this release: copied from Ruby sources. The note says
    /// from where, and is printed as a `// from ...` line before the field. Not compared.
    NotMeasured(&'static str),
    /// Not in rbspy-ruby-structs for any release (enums bindgen did not emit, a struct it
    /// left out), so typed in from Ruby's headers like `NotMeasured`, but compared by
    /// `--check`: the probe compiles the same headers, so a mismatch is a wrong transcription
    /// (or a release where the headers changed and this program did not follow).
    Transcribed(&'static str),
}

#[derive(Clone, Debug)]
pub struct Field {
    pub name: &'static str,
    pub val: Val,
    pub source: Source,
}

/// The fields of one release, in `struct Layout` order.
#[derive(Clone, Debug)]
pub struct Layout {
    /// "MAJOR.MINOR", the `name` field.
    pub name: String,
    pub fields: Vec<Field>,
}

impl Layout {
    pub fn new(name: String) -> Self {
        Layout {
            name,
            fields: Vec::new(),
        }
    }

    pub fn get(&self, name: &str) -> Option<&Field> {
        self.fields.iter().find(|f| f.name == name)
    }

    fn push(&mut self, name: &'static str, val: Val, source: Source) {
        assert!(self.get(name).is_none(), "{name} set twice");
        self.fields.push(Field { name, val, source });
    }

    // Measured values (the probe's U, X, SOME, NONE, ONE_BIT).
    pub fn dec(&mut self, name: &'static str, v: impl TryInto<u64>) {
        self.push(name, Val::Dec(to_u64(v)), Source::Measured)
    }
    pub fn hex(&mut self, name: &'static str, v: impl TryInto<u64>) {
        self.push(name, Val::Hex(to_u64(v)), Source::Measured)
    }
    pub fn some(&mut self, name: &'static str, v: impl TryInto<u64>) {
        self.push(name, Val::Some(to_u64(v)), Source::Measured)
    }
    pub fn none(&mut self, name: &'static str) {
        self.push(name, Val::None, Source::Measured)
    }
    pub fn some_bit(&mut self, name: &'static str, (off, mask): (usize, u8)) {
        self.push(name, Val::SomeBit(off as u64, mask), Source::Measured)
    }

    /// A value that is not in the crate for this release (see [`Source::NotMeasured`]).
    pub fn copied(&mut self, name: &'static str, val: Val, from: &'static str) {
        self.push(name, val, Source::NotMeasured(from))
    }

    /// A value typed in from Ruby's headers and checked (see [`Source::Transcribed`]).
    pub fn transcribed(&mut self, name: &'static str, val: Val, from: &'static str) {
        self.push(name, val, Source::Transcribed(from))
    }
}

fn to_u64(v: impl TryInto<u64>) -> u64 {
    v.try_into()
        .unwrap_or_else(|_| panic!("value does not fit u64"))
}

impl fmt::Display for Layout {
    /// Exactly the probe's text: `Layout {`, `    name: value,` lines, `}`. A not-measured
    /// field is preceded by its `// from ...` note (once for a run of fields with one note).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Layout {{")?;
        writeln!(f, "    name: \"{}\",", self.name)?;
        let mut last_note = None;
        for field in &self.fields {
            let note = match field.source {
                Source::NotMeasured(from) | Source::Transcribed(from) => Some(from),
                Source::Measured => None,
            };
            if let Some(from) = note {
                if last_note != note {
                    for line in from.lines() {
                        writeln!(f, "    // {line}")?;
                    }
                }
            }
            last_note = note;
            writeln!(f, "    {}: {},", field.name, field.val)?;
        }
        writeln!(f, "}}")
    }
}
