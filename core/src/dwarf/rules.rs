//! A `Layout` from a Ruby's types: each field by its recipe (bindings' `members`), and the
//! fields that take a rule, here, each decided by what the types have.

use super::types::{Member, TypeError, Types};
use rbspy_ext_bindings::members::{recipe, Recipe, MEMBERS};
use rbspy_ext_bindings::{FieldValue, Layout};

type Result<T> = std::result::Result<T, TypeError>;

/// Every name the recipes look up: types (as spelled in C) and enumerators.
pub fn wanted() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = Vec::new();
    for (_, r) in MEMBERS {
        match *r {
            Recipe::Off(p)
            | Recipe::SomeOff(p)
            | Recipe::OffOrZero(p)
            | Recipe::Bits(p)
            | Recipe::Rule(p) => names.extend(p.iter().map(|(t, _)| *t)),
            Recipe::MemberSize(t, _) => names.push(t),
            Recipe::Size(t) | Recipe::Enum(t) => names.extend_from_slice(t),
            Recipe::Fixed(_) => {}
        }
    }
    names.extend(RULE_NAMES);
    names.sort_unstable();
    names.dedup();
    names
}

/// Enumerators and types only rules read.
const RULE_NAMES: &[&str] = &[
    "RSTRING_EMBED_LEN_MASK",
    "RSTRING_EMBED_LEN_SHIFT",
    "BUILTIN_ATTR_C_TRACE",
    "SHAPE_IVAR",
    "rb_darray_meta_t",
    "struct RClass",
    "rb_shape_t",
];

/// The layout `types` describe, for Ruby `version` ("3.4.5"), named `name`.
pub fn build(types: &Types, version: &str, name: &'static str) -> Result<Layout> {
    let api_version = api_version(version)?;
    let mut b = Builder {
        types,
        api_version,
        done: Vec::new(),
    };
    Layout::from_fields(
        name,
        |field| {
            let v = b.field(field)?;
            b.done.push((field, v));
            Ok(v)
        },
        |field, v| TypeError::Corrupt(format!("{field} = {v} does not fit its field")),
    )
}

fn api_version(version: &str) -> Result<u64> {
    let mut parts = version.split('.').map(|p| p.parse::<u64>());
    match (parts.next(), parts.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => Ok(major * 100 + minor),
        _ => Err(TypeError::Missing(format!("a version: {version:?}"))),
    }
}

struct Builder<'t, 'a> {
    types: &'t Types<'a>,
    api_version: u64,
    /// Fields already made, in `Layout::FIELDS` order: rules read earlier ones.
    done: Vec<(&'static str, FieldValue)>,
}

impl Builder<'_, '_> {
    fn earlier(&self, field: &str) -> FieldValue {
        self.done
            .iter()
            .find(|(f, _)| *f == field)
            .map_or(FieldValue::Absent, |(_, v)| *v)
    }

    fn first(&self, paths: &[(&str, &str)]) -> Result<Option<Member>> {
        for (ty, path) in paths {
            if let Some(m) = self.types.member(ty, path)? {
                return Ok(Some(m));
            }
        }
        Ok(None)
    }

    fn has(&self, ty: &str, path: &str) -> Result<bool> {
        Ok(self.types.member(ty, path)?.is_some())
    }

    fn off(&self, ty: &str, path: &str) -> Result<FieldValue> {
        Ok(self
            .types
            .member(ty, path)?
            .map_or(FieldValue::Absent, |m| FieldValue::Num(m.offset)))
    }

    fn enumerator(&self, name: &str) -> Result<u64> {
        self.types
            .enumerator(name)
            .map(|v| v as u64)
            .ok_or_else(|| TypeError::Missing(format!("the enumerator {name}")))
    }

    fn field(&self, field: &'static str) -> Result<FieldValue> {
        let missing = |what: String| TypeError::Missing(format!("{what}, for {field}"));
        let named = |p: &[(&str, &str)]| {
            p.iter()
                .map(|(t, m)| format!("{t}.{m}"))
                .collect::<Vec<_>>()
                .join(" or ")
        };
        let r = recipe(field).ok_or_else(|| missing("a recipe".into()))?;
        Ok(match r {
            Recipe::Off(p) => {
                FieldValue::Num(self.first(p)?.ok_or_else(|| missing(named(p)))?.offset)
            }
            Recipe::SomeOff(p) => self
                .first(p)?
                .map_or(FieldValue::Absent, |m| FieldValue::Num(m.offset)),
            Recipe::OffOrZero(p) => FieldValue::Num(self.first(p)?.map_or(0, |m| m.offset)),
            Recipe::Size(t) => {
                let size = t
                    .iter()
                    .find_map(|t| self.types.size_of(t).transpose())
                    .transpose()?;
                FieldValue::Num(size.ok_or_else(|| missing(t.join(" or ")))?)
            }
            Recipe::MemberSize(t, m) => FieldValue::Num(
                self.types
                    .member(t, m)?
                    .ok_or_else(|| missing(format!("{t}.{m}")))?
                    .size,
            ),
            Recipe::Bits(p) => match self.first(p)? {
                Some(m) => bits_of(m).ok_or_else(|| {
                    TypeError::Corrupt(format!("{field}: not a bitfield within one byte"))
                })?,
                None => FieldValue::Absent,
            },
            Recipe::Enum(names) => {
                let v = names.iter().find_map(|n| self.types.enumerator(n));
                FieldValue::Num(
                    v.ok_or_else(|| missing(format!("the enumerator {}", names.join(" or "))))?
                        as u64,
                )
            }
            Recipe::Fixed(v) => FieldValue::Num(v),
            Recipe::Rule(p) => self.rule(field, p)?,
        })
    }

    /// The fields whose value is not one member's offset, by area.
    fn rule(&self, field: &'static str, p: &[(&str, &str)]) -> Result<FieldValue> {
        let found = match self.vm_rule(field, p)? {
            Some(v) => Some(v),
            None => match self.iseq_rule(field, p)? {
                Some(v) => Some(v),
                None => match self.object_rule(field, p)? {
                    Some(v) => Some(v),
                    None => self.symbol_rule(field, p)?,
                },
            },
        };
        found.ok_or_else(|| TypeError::Missing(format!("a rule for {field}")))
    }

    /// The VM's, the threads' and the GC's, and the frames' under 4.1's ZJIT.
    fn vm_rule(&self, field: &'static str, p: &[(&str, &str)]) -> Result<Option<FieldValue>> {
        let num = FieldValue::Num;
        let zjit = || self.has("rb_control_frame_t", "_iseq");
        Ok(Some(match field {
            "api_version" => num(self.api_version),
            // The unblocking function tells a queued thread from one on the ubf list only
            // where both lists share one node (before 3.3).
            "thread_unblock_func" => {
                let wait = self.earlier("thread_gvl_wait_node");
                let ubf = self.first(&p[1..])?.map(|m| num(m.offset));
                if ubf == Some(wait) {
                    self.off(p[0].0, p[0].1)?
                } else {
                    FieldValue::Absent
                }
            }
            "objspace_during_gc_bit" => {
                let flags = self
                    .types
                    .member(p[0].0, "flags")?
                    .ok_or_else(|| TypeError::Missing("struct rb_objspace.flags".into()))?;
                let m = self.types.member(p[0].0, p[0].1)?.ok_or_else(|| {
                    TypeError::Missing("struct rb_objspace.flags.during_gc".into())
                })?;
                let (bit, _) = m
                    .bits
                    .ok_or_else(|| TypeError::Corrupt("during_gc is not a bitfield".into()))?;
                num(bit - flags.offset * 8)
            }
            "cfp_jit_return" => match zjit()? {
                true => self.off(p[0].0, p[0].1)?,
                false => FieldValue::Absent,
            },
            // zjit.h's JITFrame {pc, iseq}, which the probe copies too.
            "zjit_frame_pc" => num(0),
            "zjit_frame_iseq" => num(if zjit()? { 8 } else { 0 }),
            "zjit_return_c_frame" => num(u64::from(zjit()?)),
            _ => return Ok(None),
        }))
    }

    /// The iseqs', their line tables' and the method definitions'.
    fn iseq_rule(&self, field: &'static str, p: &[(&str, &str)]) -> Result<Option<FieldValue>> {
        let num = FieldValue::Num;
        Ok(Some(match field {
            // 3.4's BUILTIN_ATTR_C_TRACE; from 4.0 every internal frame is located at its
            // caller (Layout::locates_internal_frames_at_their_caller), these with them.
            "body_c_trace" => match (
                self.types.enumerator("BUILTIN_ATTR_C_TRACE"),
                self.types.member(p[0].0, p[0].1)?,
            ) {
                (Some(bit @ 1..=0xff), Some(m)) if self.api_version < 400 => {
                    FieldValue::Pair(m.offset, bit as u64)
                }
                _ => FieldValue::Absent,
            },
            "body_read_size" => {
                let ends = [
                    "body_type",
                    "body_iseq_encoded",
                    "body_location_first_lineno",
                    "body_insns_info_succ_index_table",
                    "body_parent_iseq",
                    "body_local_iseq",
                    "body_location_label",
                    "body_location_base_label",
                ];
                let mut end = ends
                    .iter()
                    .filter_map(|f| match self.earlier(f) {
                        FieldValue::Num(n) => Some(n + 8),
                        _ => None,
                    })
                    .max()
                    .unwrap_or(0);
                if let FieldValue::Pair(at, _) = self.earlier("body_c_trace") {
                    end = end.max(at + 8);
                }
                num(end)
            }
            // iseq.c's `imm_part[IMMEDIATE_TABLE_SIZE / 9]`.
            "succ_immediate_table_size" => {
                let m = self
                    .types
                    .member(p[0].0, p[0].1)?
                    .ok_or_else(|| TypeError::Missing("struct succ_index_table.imm_part".into()))?;
                num(m
                    .count
                    .ok_or_else(|| TypeError::Corrupt("imm_part has no bound".into()))?
                    * 9)
            }
            "me_def_type_mask" | "me_def_type_shift" => {
                let m = self
                    .types
                    .member(p[0].0, p[0].1)?
                    .ok_or_else(|| TypeError::Missing("rb_method_definition_t.type".into()))?;
                let (bit, width) =
                    m.bits
                        .filter(|(b, w)| b + w <= 64 && *w > 0)
                        .ok_or_else(|| {
                            TypeError::Corrupt(
                                "def->type is not a bitfield in the first word".into(),
                            )
                        })?;
                match field {
                    "me_def_type_mask" => num(((1u64 << width) - 1) << bit),
                    _ => num(bit),
                }
            }
            _ => return Ok(None),
        }))
    }

    /// The strings', the classes' and 3.2's shapes'.
    fn object_rule(&self, field: &'static str, p: &[(&str, &str)]) -> Result<Option<FieldValue>> {
        let num = FieldValue::Num;
        let shapes = || self.has("rb_vm_t", "shape_list");
        Ok(Some(match field {
            "rstring_embed_len_mask" | "rstring_embed_len_shift" => match self.first(&[
                ("struct RString", "len"),
                ("struct RString", "as.embed.len"),
            ])? {
                None => num(self.enumerator(if field.ends_with("mask") {
                    "RSTRING_EMBED_LEN_MASK"
                } else {
                    "RSTRING_EMBED_LEN_SHIFT"
                })?),
                _ => num(0),
            },
            "rclass_ext_inline" => {
                match (self.off(p[0].0, p[0].1)?, self.earlier("rclass_ext_ptr")) {
                    (FieldValue::Num(n), _) => num(n),
                    (_, FieldValue::Absent) => num(self
                        .types
                        .size_of("struct RClass")?
                        .ok_or_else(|| TypeError::Missing("struct RClass".into()))?),
                    _ => FieldValue::Absent,
                }
            }
            "classext_iv_tbl" => match self.earlier("rclass_ext_ptr") {
                FieldValue::Absent => FieldValue::Absent,
                _ => self.off(p[0].0, p[0].1)?,
            },
            "classext_iv_ptr"
            | "shape_edge_name"
            | "shape_next_iv_index"
            | "shape_type"
            | "shape_parent_id" => match shapes()? {
                true => num(self
                    .first(&p[..1])?
                    .ok_or_else(|| TypeError::Missing(format!("{}.{}", p[0].0, p[0].1)))?
                    .offset),
                false if field == "classext_iv_ptr" => FieldValue::Absent,
                false => num(0),
            },
            "shape_flag_shift" => num(if shapes()? { 32 } else { 0 }), // SHAPE_FLAG_SHIFT, a #define
            "shape_size" => num(if shapes()? {
                self.types.size_of("rb_shape_t")?.unwrap_or(0)
            } else {
                0
            }),
            "shape_type_ivar" => num(if shapes()? {
                self.enumerator("SHAPE_IVAR")?
            } else {
                0
            }),
            "shape_invalid_id" => num(if shapes()? { u32::MAX as u64 } else { 0 }), // INVALID_SHAPE_ID
            _ => return Ok(None),
        }))
    }

    /// The symbol table's (4.1's chunks and their directory).
    fn symbol_rule(&self, field: &'static str, p: &[(&str, &str)]) -> Result<Option<FieldValue>> {
        let num = FieldValue::Num;
        let chunks = || self.types.member("struct sym_id_entry", "str");
        Ok(Some(match field {
            "id_chunk_data" => match chunks()? {
                Some(_) => self.off(p[0].0, p[0].1)?,
                None => FieldValue::Absent,
            },
            "id_chunk_header" => num(match chunks()? {
                Some(_) => self
                    .types
                    .size_of("rb_darray_meta_t")?
                    .ok_or_else(|| TypeError::Missing("rb_darray_meta_t".into()))?,
                None => 0,
            }),
            "id_entry_str" => num(chunks()?.map_or(0, |m| m.offset / 8)),
            "id_dir" => match (
                self.types.member(p[0].0, p[0].1)?,
                self.types.member(p[1].0, p[1].1)?,
            ) {
                (Some(capa), Some(entries)) => FieldValue::Pair(capa.offset, entries.offset),
                _ => FieldValue::Absent,
            },
            _ => return Ok(None),
        }))
    }
}

/// (byte offset, mask) of a bitfield that lies within one byte.
pub(super) fn bits_of(m: Member) -> Option<FieldValue> {
    let (bit, width) = m.bits?;
    let (byte, shift) = (bit / 8, bit % 8);
    (width > 0 && shift + width <= 8)
        .then(|| FieldValue::Pair(byte, ((1u64 << width) - 1) << shift))
}
