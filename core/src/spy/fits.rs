//! Whether a layout fits a process: the main thread's stack checked once the VM's
//! back-pointers validate, and the error when no layout fits (attach.rs asks both).
use crate::error::{Error, Result};
use crate::memory::{field, word, Memory, ProcessMemory};
use crate::objects::{read_array_entry, read_string};
use crate::process::{Identity, RubyBinary};
use crate::vm::{plausible, VmRoots};
use rbspy_ext_bindings::Layout;

/// What the main thread's stack says of a layout whose VM validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MainStack {
    /// A frame runs an iseq whose path reads as a String: the layout fits.
    Fits,
    /// No frame runs an iseq yet (a Ruby still starting, or one with no Ruby code on its
    /// main thread): nothing contradicts the layout.
    NoRubyFrame,
    /// What does not fit: the layout is not this Ruby's.
    Misfit(String),
}

/// Most frames looked at for one iseq with a path (the main script's is usually the last).
const MAX_CHECKED_FRAMES: u64 = 100_000;

/// Checks a validated VM's main thread further, as a layout guessed for an unknown release
/// must be: its execution context, the control frames between its `cfp` and the end of its
/// stack, and an iseq among them with a readable path (the main script's, `<main>`).
/// Back-pointers alone can validate a VM whose later fields moved.
pub fn check_main_stack<M: Memory>(mem: &M, l: &Layout, roots: &VmRoots) -> MainStack {
    let misfit = |what: &str| MainStack::Misfit(what.to_string());
    let Ok(ec) = mem.read_u64(field(roots.main_thread, l.thread_ec)) else {
        return misfit("the main thread's execution context is unreadable");
    };
    if !plausible(ec) {
        return misfit("the main thread has no execution context");
    }
    let mut head = [0u8; 24];
    if mem.read(field(ec, l.ec_vm_stack), &mut head).is_err() {
        return misfit("the main execution context is unreadable");
    }
    let (stack, size) = (word(&head, 0), word(&head, 8));
    let cfp = word(&head, l.ec_cfp - l.ec_vm_stack);
    let end = stack.wrapping_add(size.wrapping_mul(8));
    if !plausible(stack) || size == 0 || size > 1 << 28 || !(stack..=end).contains(&cfp) {
        return misfit("the main execution context's stack and frame pointer do not agree");
    }
    // Frames are pushed down from the end of the stack, whole frames at a time.
    if !(end - cfp).is_multiple_of(l.cfp_size as u64) {
        return misfit("the main thread's frames are not whole control frames");
    }
    let count = ((end - cfp) / l.cfp_size as u64).min(MAX_CHECKED_FRAMES);
    let Ok(frames) = mem.read_vec(cfp, (count as usize) * l.cfp_size) else {
        return misfit("the main thread's control frames are unreadable");
    };
    let mut fits = false;
    for f in frames.chunks_exact(l.cfp_size) {
        let iseq = word(f, l.cfp_iseq);
        if word(f, l.cfp_pc) == 0 {
            continue; // a C function's frame, a block of C code (ifunc), or a dummy frame
        }
        // Not every frame with a pc runs an iseq: YJIT leaves a C method's frame the pc of
        // the slot's previous frame.
        let is_iseq = plausible(iseq)
            && mem.read_u64(iseq).is_ok_and(|flags| {
                flags & l.t_mask == l.t_imemo && (flags >> l.fl_ushift) & 0xf == l.imemo_iseq
            });
        if !is_iseq || fits {
            continue;
        }
        let path = mem
            .read_u64(field(iseq, l.iseq_body))
            .and_then(|body| mem.read_u64(field(body, l.body_location_pathobj)));
        let Ok(path) = path else {
            return misfit("an iseq of the main thread has an unreadable body");
        };
        // pathobj: the path, or [path, realpath].
        fits = read_string(mem, l, path).is_ok()
            || read_array_entry(mem, l, path, 0).is_ok_and(|p| read_string(mem, l, p).is_ok());
        if !fits {
            return misfit("an iseq of the main thread has no readable path");
        }
    }
    if fits {
        return MainStack::Fits;
    }
    MainStack::NoRubyFrame
}

/// How long a Ruby may take to set up its VM: a VM that does not validate in an older process
/// means the layout does not fit, not a Ruby still starting.
const STARTUP: std::time::Duration = std::time::Duration::from_secs(2);

/// The error for a process where no candidate layout fitted (`error`, the first layout's):
/// in a process older than [`STARTUP`] whose VM pointer is set, the layout is not this
/// Ruby's, which `UnsupportedVersion` says, naming its `RUBY_DESCRIPTION` (date and revision
/// for a dev build) and the Rubies this build knows; younger, it may still be starting (the
/// `NotRuby` that says "try again").
pub(super) fn not_fitting(
    pid: i32,
    identity: Option<&Identity>,
    binary: &RubyBinary,
    mem: &ProcessMemory,
    found: &str,
    wanted: &str,
    error: Error,
) -> Error {
    let Error::NotRuby { detail, .. } = &error else {
        return error;
    };
    // What did not validate, without the "may still be starting" that no longer applies.
    let reason = detail.split(" (Ruby ").next().unwrap_or(detail);
    let young = identity
        .and_then(Identity::age)
        .is_none_or(|age| age < STARTUP);
    if young {
        return error;
    }
    let description = binary
        .symbol("ruby_description")
        .and_then(|at| mem.read_vec(at, 160).ok())
        .map(|raw| {
            String::from_utf8_lossy(raw.split(|b| *b == 0).next().unwrap_or(&[])).into_owned()
        })
        .filter(|d| d.starts_with("ruby "))
        .unwrap_or_else(|| format!("ruby {found}"));
    let layout = if wanted == found {
        format!("the layout this build has for {wanted}")
    } else {
        format!("the forced layout of {wanted}")
    };
    Error::UnsupportedVersion {
        pid,
        version: found.to_string(),
        detail: format!(
            "{description}: its memory does not fit {layout} ({reason}); this build knows \
             Ruby {}. A newer rbspy_ext may know this build; docs/adding-a-ruby.md adds one",
            rbspy_ext_bindings::known_series()
        ),
    }
}

/// The roots of a VM that validated, once its main thread's stack agrees with the layout
/// (`check_main_stack`): a VM's back-pointers can validate while fields after them moved.
pub(super) fn fitting(
    pid: i32,
    mem: &ProcessMemory,
    layout: &'static Layout,
    roots: VmRoots,
    found: &str,
) -> Result<VmRoots> {
    // The main thread runs on while it is read: a frame popped and pushed again between the
    // reads of its context and its frames can look torn, so a misfit must be seen thrice.
    let mut verdict = check_main_stack(mem, layout, &roots);
    for _ in 0..2 {
        if !matches!(verdict, MainStack::Misfit(_)) {
            break;
        }
        verdict = check_main_stack(mem, layout, &roots);
    }
    match verdict {
        MainStack::Fits | MainStack::NoRubyFrame => Ok(roots),
        MainStack::Misfit(what) => Err(Error::NotRuby {
            pid,
            detail: format!(
                "its VM validates, but {what} (Ruby {found} may still be starting: try again; \
                 or check force_version)"
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryImage;
    use rbspy_ext_bindings::LAYOUTS;

    /// The main stack's checks on a made-up address space: a context with no stack, a frame
    /// pointer outside it or between frames are misfits; whole frames with no iseq (C
    /// functions', or one with a stale pc) say nothing.
    #[test]
    fn main_stack_misfits_are_told_apart_from_a_stack_with_no_ruby_frame() {
        for l in LAYOUTS {
            let (thread, ec, stack, not_iseq) = (0x10000u64, 0x20000u64, 0x30000u64, 0x50000u64);
            let size = 0x1000u64; // VALUEs
            let end = stack + size * 8;
            let build = |ec_ptr: u64, cfp: u64, frame_pc: u64| {
                let mut mem = MemoryImage::new();
                let mut t = vec![0u8; 0x400];
                t[l.thread_ec..l.thread_ec + 8].copy_from_slice(&ec_ptr.to_le_bytes());
                mem.map(thread, t);
                let mut e = vec![0u8; 0x100];
                e[l.ec_vm_stack..l.ec_vm_stack + 8].copy_from_slice(&stack.to_le_bytes());
                e[l.ec_vm_stack_size..l.ec_vm_stack_size + 8].copy_from_slice(&size.to_le_bytes());
                e[l.ec_cfp..l.ec_cfp + 8].copy_from_slice(&cfp.to_le_bytes());
                mem.map(ec, e);
                let mut s = vec![0u8; (size * 8) as usize];
                // Two frames at the end of the stack; the inner one has a pc, its iseq is not one.
                let inner = (end - 2 * l.cfp_size as u64 - stack) as usize;
                s[inner + l.cfp_pc..inner + l.cfp_pc + 8].copy_from_slice(&frame_pc.to_le_bytes());
                s[inner + l.cfp_iseq..inner + l.cfp_iseq + 8]
                    .copy_from_slice(&not_iseq.to_le_bytes());
                mem.map(stack, s);
                mem.map(not_iseq, vec![0u8; 64]);
                mem
            };
            let roots = VmRoots {
                vm: 0x1000,
                main_thread: thread,
                gvl_owner: 0,
                thread_list: 0,
            };
            let two_frames = end - 2 * l.cfp_size as u64;
            let verdict = |mem: &MemoryImage| check_main_stack(mem, l, &roots);
            assert_eq!(
                verdict(&build(ec, two_frames, 0)),
                MainStack::NoRubyFrame,
                "{}",
                l.name
            );
            for (mem, why) in [
                (build(0, two_frames, 0), "no execution context"),
                (build(ec, end + 8, 0), "do not agree"),
                (build(ec, two_frames + 8, 0), "not whole control frames"),
            ] {
                match verdict(&mem) {
                    MainStack::Misfit(what) => assert!(what.contains(why), "{}: {what}", l.name),
                    other => panic!("{}: {other:?}, expected a misfit ({why})", l.name),
                }
            }
        }
    }
}
