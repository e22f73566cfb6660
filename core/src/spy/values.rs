//! A VALUE as the text a tag shows (spy/tags.rs): the immediates decoded, Strings and
//! Symbols read, any other object named by its class.
use crate::error::{ObjResult, ObjectError};
use crate::memory::{field, Memory};
use crate::objects::{is_heap_object, read_string, ClassNames, SymbolTable};
use rbspy_ext_bindings::Layout;
use std::sync::Arc;

/// A VALUE as text, the way a tag is shown: Strings, Symbols, Integers, Floats,
/// true/false/nil as themselves, anything else as its class name. None when the object
/// cannot be read now (a live value can sit on a page that Ruby 3.0/3.1's `GC.compact` has
/// made unreadable, PROT_NONE, while it compacts: a placeholder would be an invented tag),
/// when `v` is no VALUE at all, or when an object's class needs the symbol table and there
/// is none.
pub(super) fn value_text<M: Memory>(
    mem: &M,
    l: &Layout,
    symbols: Option<&mut SymbolTable>,
    classes: &mut ClassNames,
    v: u64,
) -> Option<Arc<str>> {
    if v == l.qfalse {
        return Some("false".into());
    }
    if v == l.qnil {
        return Some("nil".into());
    }
    if v == l.qtrue {
        return Some("true".into());
    }
    if v & l.fixnum_flag != 0 {
        return Some(((v as i64) >> 1).to_string().into());
    }
    if v & l.flonum_mask == l.flonum_flag {
        return Some(flonum(v).to_string().into());
    }
    if v & ((1 << l.special_shift) - 1) == l.symbol_flag {
        let name = symbols.and_then(|s| s.name(mem, l, v >> l.special_shift).ok());
        return Some(name.unwrap_or_else(|| Arc::from("Symbol")));
    }
    if !is_heap_object(v) {
        return None;
    }
    let flags = mem.read_u64(field(v, l.rbasic_flags)).ok()?;
    let t = flags & l.t_mask;
    Some(if t == l.t_string {
        string_or(read_string(mem, l, v), "String")?
    } else if t == l.t_symbol {
        // A dynamic Symbol (made at run time): its name is a String of its own.
        let fstr = mem.read_u64(field(v, l.rsymbol_fstr)).ok()?;
        string_or(read_string(mem, l, fstr), "Symbol")?
    } else {
        let class = mem.read_u64(field(v, l.rbasic_klass)).ok()?;
        classes
            .class_name(mem, l, symbols?, class)
            .unwrap_or_else(|| Arc::from("Object"))
    })
}

/// A String's text; `shape` when it is too long or not a String after all; None when its
/// memory cannot be read now.
fn string_or(read: ObjResult<String>, shape: &str) -> Option<Arc<str>> {
    match read {
        Ok(text) => Some(text.into()),
        Err(ObjectError::Shape(..)) => Some(shape.into()),
        Err(ObjectError::Memory(_)) => None,
    }
}

/// The Float a flonum VALUE stands for (Ruby's `rb_float_flonum_value`).
fn flonum(v: u64) -> f64 {
    if v == 0x8000_0000_0000_0002 {
        return 0.0;
    }
    let b63 = v >> 63;
    let t = (2u64.wrapping_sub(b63)) | (v & !3);
    f64::from_bits(t.rotate_right(3))
}

#[cfg(test)]
mod tests {
    use super::flonum;

    #[test]
    fn flonums_decode_like_ruby() {
        // Ruby encodes a flonum as the double's bits rotated left by 3, low bits 0b10.
        for x in [1.5f64, -2.25, 1e10, 0.1] {
            let bits = x.to_bits();
            let v = (bits.rotate_left(3) & !1) | 2;
            assert_eq!(flonum(v), x, "{x}");
        }
        assert_eq!(flonum(0x8000_0000_0000_0002), 0.0);
    }
}
