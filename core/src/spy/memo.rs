//! The stack memo: frames already resolved, by raw stack. A stack whose raw words (each
//! frame's iseq, pc and environment, see `sign`) were resolved before in the current epoch is
//! answered without resolving anything. The walker is a function of the raw words and of its
//! caches, and the caches are trusted for exactly one epoch: whoever validates or drops them
//! calls [`StackMemo::invalidate`].
use super::envs::Envs;
use super::leaves::{RawFrame, Stack};
use crate::model::Frame;
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// Most distinct raw stacks remembered with their frames.
const MAX_MEMO: usize = 16_384;
/// And at most this many bytes of them (signatures and frames, roughly): a target that starts
/// threads all the time puts every stack at new addresses, so the memo fills with stacks that
/// never come back; deep stacks would make 16k of them ~100 MB, while a few thousand of the
/// stacks a steady program repeats fit in 8 MB.
const MAX_MEMO_BYTES: usize = 8 << 20;

#[derive(Debug, Default)]
pub(super) struct StackMemo {
    stacks: FxHashMap<Box<[u64]>, Remembered>,
    /// What `stacks` holds, roughly, in bytes.
    bytes: usize,
    /// Bumped whenever the caches behind the memo are validated or dropped.
    epoch: u64,
    /// Last token handed out (`Stack::token`).
    tokens: u64,
    /// The signature of the stack being walked (reused buffer).
    signature: Vec<u64>,
}

#[derive(Debug)]
struct Remembered {
    stack: Stack,
    epoch: u64,
}

impl StackMemo {
    /// Forgets every stack resolved so far (their tokens survive while frames stay equal).
    pub(super) fn invalidate(&mut self) {
        self.epoch += 1;
    }

    /// The current epoch: a stack resolved now is remembered under it.
    pub(super) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Makes the raw stack the one [`StackMemo::get`] and [`StackMemo::remember`] are about.
    /// What the frames depend on besides the walker's caches: each frame's iseq, pc and
    /// environment address, and the environment's slots when it lives on the value stack
    /// (method entry or cref, block handler or parent, flags).
    pub(super) fn sign(&mut self, frames: &[RawFrame], envs: &Envs) {
        let sig = &mut self.signature;
        sig.clear();
        for f in frames {
            sig.extend_from_slice(&[f.iseq, f.pc, f.ep]);
            if let Some(s) = envs.on_stack(f.ep) {
                sig.extend_from_slice(&[s.me_cref, s.specval, s.flags]);
            }
        }
    }

    /// The signed stack, if it was resolved in the current epoch.
    pub(super) fn get(&self) -> Option<Stack> {
        self.stacks
            .get(&self.signature[..])
            .filter(|m| m.epoch == self.epoch)
            .map(|m| m.stack.clone())
    }

    /// Remembers the signed stack's frames, resolved in `epoch`, and names them: the token
    /// stays the same while the frames do, so a stack keeps one name.
    pub(super) fn remember(&mut self, frames: Arc<[Frame]>, epoch: u64) -> Stack {
        if self.stacks.len() >= MAX_MEMO || self.bytes >= MAX_MEMO_BYTES {
            self.stacks.clear();
            self.bytes = 0;
        }
        let token = match self.stacks.get(&self.signature[..]) {
            Some(m) if m.stack.frames == frames => m.stack.token,
            _ => {
                self.tokens += 1;
                self.tokens
            }
        };
        let stack = Stack { frames, token };
        self.bytes += self.signature.len() * 8
            + stack.frames.len() * std::mem::size_of::<Frame>()
            + std::mem::size_of::<Remembered>();
        self.stacks.insert(
            self.signature.as_slice().into(),
            Remembered {
                stack: stack.clone(),
                epoch,
            },
        );
        stack
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(label: &str) -> Arc<[Frame]> {
        let s: Arc<str> = label.into();
        vec![Frame {
            label: s.clone(),
            base_label: s,
            path: "t.rb".into(),
            absolute_path: None,
            lineno: 1,
            c_function: false,
        }]
        .into()
    }

    fn signed(words: &[u64]) -> StackMemo {
        let mut m = StackMemo::default();
        m.signature.extend_from_slice(words);
        m
    }

    #[test]
    fn answers_a_stack_only_within_its_epoch() {
        let mut m = signed(&[1, 2, 3]);
        assert!(m.get().is_none());
        let first = m.remember(frames("a"), m.epoch());
        assert_eq!(m.get().unwrap().token, first.token);
        m.invalidate();
        assert!(m.get().is_none(), "a new epoch distrusts what was resolved");
    }

    #[test]
    fn keeps_a_token_while_frames_stay_equal() {
        let mut m = signed(&[1, 2, 3]);
        let a = m.remember(frames("a"), m.epoch());
        m.invalidate();
        let again = m.remember(frames("a"), m.epoch());
        assert_eq!(a.token, again.token);
        m.invalidate();
        let changed = m.remember(frames("b"), m.epoch());
        assert_ne!(a.token, changed.token);
    }

    #[test]
    fn stays_within_its_bound() {
        let mut m = StackMemo::default();
        for i in 0..(MAX_MEMO as u64 + 10) {
            m.signature.clear();
            m.signature.push(i);
            m.remember(frames("a"), m.epoch());
        }
        assert!(m.stacks.len() <= MAX_MEMO);
        assert!(m.bytes <= MAX_MEMO_BYTES + 4096);
    }
}
