//! The types a layout needs, read from DWARF with gimli: struct, union and typedef
//! definitions by name, and enumerators by name. One pass over the compile units' top-level
//! entries notes where each is; members are then read where they are, following type
//! references. Nothing else of the DWARF is kept, and every walk is bounded, so a cyclic or
//! huge type graph ends in an error, not a hang.

use gimli::{AttributeValue, EndianSlice, LittleEndian, UnitOffset};
use std::collections::HashMap;

pub(super) type Slice<'a> = EndianSlice<'a, LittleEndian>;

/// Typedef, qualifier and anonymous-member hops a walk may take before it is called cyclic.
const MAX_HOPS: usize = 32;
/// Compile units read at most: a Ruby has a few hundred.
const MAX_UNITS: usize = 100_000;

/// Why the debug information could not give a layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TypeError {
    /// The DWARF does not parse.
    Corrupt(String),
    /// A type or member the layout needs is not there.
    Missing(String),
}

impl From<gimli::Error> for TypeError {
    fn from(e: gimli::Error) -> Self {
        TypeError::Corrupt(e.to_string())
    }
}

type Result<T> = std::result::Result<T, TypeError>;

/// Where a DIE is: the unit (an index into `Types::units`) and its offset in it.
#[derive(Debug, Clone, Copy)]
struct At {
    unit: usize,
    offset: UnitOffset,
}

/// A member found by its path.
#[derive(Debug, Clone, Copy)]
pub struct Member {
    /// Byte offset from the start of the outermost type.
    pub offset: u64,
    /// `sizeof` the member's type (0 when it has none: a flexible array).
    pub size: u64,
    /// A bitfield's (bit offset from the outer type's first byte, width); `offset` is then
    /// that of the struct holding it.
    pub bits: Option<(u64, u64)>,
    /// Elements, when the member is an array with a known bound.
    pub count: Option<u64>,
}

pub struct Types<'a> {
    dwarf: gimli::Dwarf<Slice<'a>>,
    units: Vec<gimli::Unit<Slice<'a>>>,
    /// "struct X", "union X" and typedef names → their first definition.
    named: HashMap<String, At>,
    enumerators: HashMap<String, i64>,
}

/// One step of a member path (`find_member`): the member's type, its byte offset in the
/// struct, and its bitfield's (first bit, width) where it is one.
struct Found {
    ty: At,
    offset: u64,
    bits: Option<(u64, u64)>,
}

impl<'a> Types<'a> {
    /// Indexes `dwarf`, stopping early once every name in `wanted` (types as spelled in C,
    /// and enumerators) has been seen.
    pub fn index(dwarf: gimli::Dwarf<Slice<'a>>, wanted: &[&str]) -> Result<Types<'a>> {
        let mut types = Types {
            dwarf,
            units: Vec::new(),
            named: HashMap::new(),
            enumerators: HashMap::new(),
        };
        let mut left: Vec<&str> = wanted.to_vec();
        let mut headers = types.dwarf.units();
        while let Some(header) = headers.next()? {
            if types.units.len() >= MAX_UNITS {
                return Err(TypeError::Corrupt(format!("more than {MAX_UNITS} units")));
            }
            let unit = types.dwarf.unit(header)?;
            let index = types.units.len();
            let found = types.index_unit(&unit, index)?;
            types.units.push(unit);
            if found {
                left.retain(|n| {
                    !types.named.contains_key(*n) && !types.enumerators.contains_key(*n)
                });
                if left.is_empty() {
                    break;
                }
            }
        }
        Ok(types)
    }

    /// Notes the unit's top-level named types and enumerators; whether it noted any.
    fn index_unit(&mut self, unit: &gimli::Unit<Slice<'a>>, index: usize) -> Result<bool> {
        let mut cursor = unit.entries();
        let mut found = false;
        // The unit's own entry, then its children, skipping their subtrees but an enum's.
        if cursor.next_dfs()?.is_none() {
            return Ok(false);
        }
        let mut next = cursor.next_dfs()?.map(|_| ());
        while next.is_some() {
            let entry = cursor.current().expect("next_dfs gave an entry");
            let tag = entry.tag();
            let offset = entry.offset();
            let declaration = matches!(
                entry.attr_value(gimli::DW_AT_declaration),
                Some(AttributeValue::Flag(true))
            );
            let name = match entry.attr_value(gimli::DW_AT_name) {
                Some(v) => Some(
                    self.dwarf
                        .attr_string(unit, v)?
                        .to_string_lossy()
                        .into_owned(),
                ),
                None => None,
            };
            let key = match (tag, name) {
                (gimli::DW_TAG_structure_type, Some(n)) if !declaration => {
                    Some(format!("struct {n}"))
                }
                (gimli::DW_TAG_union_type, Some(n)) if !declaration => Some(format!("union {n}")),
                (gimli::DW_TAG_typedef, Some(n)) => Some(n),
                _ => None,
            };
            if let Some(key) = key {
                self.named.entry(key).or_insert_with(|| {
                    found = true;
                    At {
                        unit: index,
                        offset,
                    }
                });
            }
            if tag == gimli::DW_TAG_enumeration_type && entry.has_children() {
                let mut tree = unit.entries_tree(Some(offset))?;
                let mut children = tree.root()?.children();
                while let Some(child) = children.next()? {
                    let e = child.entry();
                    if e.tag() != gimli::DW_TAG_enumerator {
                        continue;
                    }
                    let (Some(n), Some(v)) = (
                        e.attr_value(gimli::DW_AT_name),
                        e.attr_value(gimli::DW_AT_const_value),
                    ) else {
                        continue;
                    };
                    let n = self
                        .dwarf
                        .attr_string(unit, n)?
                        .to_string_lossy()
                        .into_owned();
                    let value = match v {
                        AttributeValue::Sdata(s) => s,
                        v => match v.udata_value() {
                            Some(u) => u as i64,
                            None => continue,
                        },
                    };
                    self.enumerators.entry(n).or_insert_with(|| {
                        found = true;
                        value
                    });
                }
            }
            next = cursor.next_sibling()?.map(|_| ());
        }
        Ok(found)
    }

    /// An enumerator's value.
    pub fn enumerator(&self, name: &str) -> Option<i64> {
        self.enumerators.get(name).copied()
    }

    /// `sizeof(ty)`, None when `ty` is not defined.
    pub fn size_of(&self, ty: &str) -> Result<Option<u64>> {
        let Some(&at) = self.named.get(ty) else {
            return Ok(None);
        };
        let at = self.strip(at)?;
        Ok(Some(self.byte_size(at)?.unwrap_or(0)))
    }

    /// The member at `path` ("a.b.c") of `ty`, None when `ty` or a step is not there.
    pub fn member(&self, ty: &str, path: &str) -> Result<Option<Member>> {
        let Some(&at) = self.named.get(ty) else {
            return Ok(None);
        };
        let mut at = self.strip(at)?;
        let mut member = Member {
            offset: 0,
            size: 0,
            bits: None,
            count: None,
        };
        for step in path.split('.') {
            let Some(Found {
                ty: found,
                offset,
                bits,
            }) = self.find_member(at, step, 0)?
            else {
                return Ok(None);
            };
            member.bits = bits.map(|(bit, width)| (member.offset * 8 + bit, width));
            member.offset += offset;
            let ty = self.strip(found)?;
            member.size = self.byte_size(ty)?.unwrap_or(0);
            member.count = self.array_count(ty)?;
            at = ty;
        }
        Ok(Some(member))
    }

    /// The member named `name` of the struct or union at `at` (looking inside anonymous
    /// members): its type, byte offset and bitfield bits.
    fn find_member(&self, at: At, name: &str, depth: usize) -> Result<Option<Found>> {
        if depth > MAX_HOPS {
            return Err(TypeError::Corrupt(
                "anonymous members nest too deep (a cycle?)".into(),
            ));
        }
        let at = self.definition(at)?;
        let unit = &self.units[at.unit];
        let mut tree = unit.entries_tree(Some(at.offset))?;
        let mut children = tree.root()?.children();
        while let Some(child) = children.next()? {
            let e = child.entry();
            if e.tag() != gimli::DW_TAG_member {
                continue;
            }
            let location = match e.attr_value(gimli::DW_AT_data_member_location) {
                None => 0,
                Some(v) => v.udata_value().ok_or_else(|| {
                    TypeError::Corrupt(format!("{name}: a member location that is not a constant"))
                })?,
            };
            let ty = match e.attr_value(gimli::DW_AT_type) {
                Some(v) => self.reference(at.unit, v)?,
                None => continue,
            };
            let width = e
                .attr_value(gimli::DW_AT_bit_size)
                .and_then(|v| v.udata_value());
            let bits = match (width, e.attr_value(gimli::DW_AT_data_bit_offset)) {
                (Some(width), Some(at)) => Some((at.udata_value().unwrap_or(0), width)),
                // DWARF 2's form: bits from the top of a `byte_size` storage unit.
                (Some(width), None) => {
                    let unit_bits = 8 * e
                        .attr_value(gimli::DW_AT_byte_size)
                        .and_then(|v| v.udata_value())
                        .unwrap_or(0);
                    let from_top = e
                        .attr_value(gimli::DW_AT_bit_offset)
                        .and_then(|v| v.udata_value())
                        .unwrap_or(0);
                    Some((
                        location * 8 + unit_bits.saturating_sub(from_top + width),
                        width,
                    ))
                }
                _ => None,
            };
            let location = if bits.is_some() { 0 } else { location };
            match e.attr_value(gimli::DW_AT_name) {
                Some(n) if self.dwarf.attr_string(unit, n)?.slice() == name.as_bytes() => {
                    return Ok(Some(Found {
                        ty,
                        offset: location,
                        bits,
                    }));
                }
                Some(_) => {}
                None => {
                    let inner = self.strip(ty)?;
                    if let Some(found) = self.find_member(inner, name, depth + 1)? {
                        return Ok(Some(Found {
                            offset: location + found.offset,
                            bits: found.bits.map(|(b, w)| (b + location * 8, w)),
                            ..found
                        }));
                    }
                }
            }
        }
        Ok(None)
    }

    /// The type behind typedefs and qualifiers.
    fn strip(&self, mut at: At) -> Result<At> {
        for _ in 0..MAX_HOPS {
            let unit = &self.units[at.unit];
            let entry = unit.entry(at.offset)?;
            match entry.tag() {
                gimli::DW_TAG_typedef
                | gimli::DW_TAG_const_type
                | gimli::DW_TAG_volatile_type
                | gimli::DW_TAG_atomic_type
                | gimli::DW_TAG_restrict_type => match entry.attr_value(gimli::DW_AT_type) {
                    Some(v) => at = self.reference(at.unit, v)?,
                    None => return Ok(at), // a typedef of void
                },
                _ => return Ok(at),
            }
        }
        Err(TypeError::Corrupt(
            "typedefs chain too long (a cycle?)".into(),
        ))
    }

    /// A struct or union declared here but defined in another unit: the definition.
    fn definition(&self, at: At) -> Result<At> {
        let unit = &self.units[at.unit];
        let entry = unit.entry(at.offset)?;
        if !matches!(
            entry.attr_value(gimli::DW_AT_declaration),
            Some(AttributeValue::Flag(true))
        ) {
            return Ok(at);
        }
        let kind = if entry.tag() == gimli::DW_TAG_union_type {
            "union"
        } else {
            "struct"
        };
        let name = match entry.attr_value(gimli::DW_AT_name) {
            Some(n) => self
                .dwarf
                .attr_string(unit, n)?
                .to_string_lossy()
                .into_owned(),
            None => return Ok(at),
        };
        self.named
            .get(&format!("{kind} {name}"))
            .copied()
            .ok_or_else(|| TypeError::Missing(format!("{kind} {name} is only declared")))
    }

    fn byte_size(&self, at: At) -> Result<Option<u64>> {
        let at = self.definition(at)?;
        let entry = self.units[at.unit].entry(at.offset)?;
        if let Some(size) = entry
            .attr_value(gimli::DW_AT_byte_size)
            .and_then(|v| v.udata_value())
        {
            return Ok(Some(size));
        }
        if entry.tag() == gimli::DW_TAG_array_type {
            let element = match entry.attr_value(gimli::DW_AT_type) {
                Some(v) => self.strip(self.reference(at.unit, v)?)?,
                None => return Ok(None),
            };
            let count = self.array_count(at)?;
            return Ok(match (count, self.byte_size(element)?) {
                (Some(c), Some(s)) => Some(c.saturating_mul(s)),
                _ => None,
            });
        }
        Ok(None)
    }

    /// Elements of the array type at `at` (its first dimension), None for another type or
    /// an array of unknown bound.
    fn array_count(&self, at: At) -> Result<Option<u64>> {
        let unit = &self.units[at.unit];
        if unit.entry(at.offset)?.tag() != gimli::DW_TAG_array_type {
            return Ok(None);
        }
        let mut tree = unit.entries_tree(Some(at.offset))?;
        let mut children = tree.root()?.children();
        while let Some(child) = children.next()? {
            let e = child.entry();
            if e.tag() != gimli::DW_TAG_subrange_type {
                continue;
            }
            if let Some(count) = e
                .attr_value(gimli::DW_AT_count)
                .and_then(|v| v.udata_value())
            {
                return Ok(Some(count));
            }
            return Ok(e
                .attr_value(gimli::DW_AT_upper_bound)
                .and_then(|v| v.udata_value())
                .map(|u| u + 1));
        }
        Ok(None)
    }

    /// Where a `DW_AT_type` reference of unit `unit` points.
    fn reference(&self, unit: usize, value: AttributeValue<Slice<'a>>) -> Result<At> {
        match value {
            AttributeValue::UnitRef(offset) => Ok(At { unit, offset }),
            AttributeValue::DebugInfoRef(offset) => {
                for (i, u) in self.units.iter().enumerate() {
                    if let Some(offset) = offset.to_unit_offset(&u.header) {
                        return Ok(At { unit: i, offset });
                    }
                }
                Err(TypeError::Corrupt(format!(
                    "a type reference to {:#x} outside the units read",
                    offset.0
                )))
            }
            v => Err(TypeError::Corrupt(format!(
                "a type reference of form {v:?}"
            ))),
        }
    }
}
