//! One sample of every selected thread, and the rules that make it consistent: which stack
//! goes with which thread's state and tags, when a walk is retried, and when a sample is
//! dropped rather than guessed. The handle (mod.rs) lends its parts for one sample
//! ([`Sampling`]); the BPF sampler's records become samples through the same parts
//! (captured.rs).
//!
//! The tag protocol, in one place. A sample's one call (batch.rs) copies each thread's
//! state, its stack's first frames and its tag pointer together. A thread's tags are decoded
//! before its stack is walked (a table is trusted only within `TABLE_WINDOW` of that call);
//! then `confirm_tags` keeps a walk only if its tags are sure to be those its stack ran
//! under, and `retry_walk` walks again, between two readings of the tags, those that are not.
use super::attach::{Check, Target};
use super::batch::{Batch, ThreadSampler};
use super::cache::Cache;
use super::leaves::{Attempt, Stack, THREAD_ATTEMPTS};
use super::memo::StackMemo;
use super::tags::{Decoder, TagReader};
use super::walker::{Prefetched, WalkState, Walker};
use crate::error::{Error, MemoryError, Result};
use crate::memory::{recycle, Memory};
use crate::model::{Dropped, Sample, SampledThread, Tags, ThreadSelection, ThreadState};
use std::time::Instant;

/// The handle's parts, lent for one sample (`Spy::sample`) or one drain of the BPF
/// sampler's records (`Spy::capture`).
pub(super) struct Sampling<'a, M: Memory> {
    pub(super) target: &'a mut Target<M>,
    pub(super) cache: &'a mut Cache,
    pub(super) walk: &'a mut WalkState,
    pub(super) memo: &'a mut StackMemo,
    pub(super) sampler: &'a mut ThreadSampler,
    pub(super) tags: &'a mut TagReader,
}

/// How a thread's walks ended (`Sampling::retry_walk`).
enum Retried {
    Walked((Stack, Tags)),
    /// It finished meanwhile: its context has no VM stack.
    Ended,
    /// Its stack (or its tags) kept moving while read: a dropped sample.
    Moved(Dropped),
}

/// What an `Attempt::Changed` whose walk is given up is dropped as.
const TAGS_CHANGED: &str = "tags changed while read";

impl<M: Memory> Sampling<'_, M> {
    /// The stack walker over the lent target and caches (see [`Walker`]).
    pub(super) fn walker(&mut self) -> Walker<'_, M> {
        Walker {
            target: self.target,
            cache: self.cache,
            walk: self.walk,
            memo: self.memo,
        }
    }

    /// The tags of the fiber a thread is running now (see `Spy::thread_tags`).
    pub(super) fn thread_tags(&mut self, thread: u64) -> Tags {
        let mut d = Decoder {
            target: self.target,
            cache: self.cache,
        };
        self.tags.thread_tags(&mut d, thread)
    }
}

impl<M: Memory> Sampling<'_, M> {
    /// One sample of the selected threads: each thread's state and stack. Threads whose
    /// stack moved while read are left out and named in `dropped`; nothing is ever invented.
    pub(super) fn sample(&mut self, which: ThreadSelection) -> Result<Sample> {
        self.target.check_identity(Check::WhenDue)?;
        let mut result = self.sample_once(which);
        // A thread that ended between the list and the read of its context fails the whole
        // read: list the threads again at once, rather than drop every thread's sample of
        // this tick. Under thread churn on a busy machine that was 0.7 % of a soak's ticks.
        if matches!(&result, Ok(s) if s.threads.is_empty() && s.dropped[..] == [Dropped::ThreadListChanged])
        {
            result = self.sample_once(which);
        }
        match result {
            // A failed read may be the process gone or replaced (see `check_identity`).
            Err(e) if !matches!(e, Error::PermissionDenied { .. }) => {
                self.target.check_identity(Check::Now)?;
                Err(e)
            }
            result => result,
        }
    }

    fn sample_once(&mut self, which: ThreadSelection) -> Result<Sample> {
        self.sampler.fresh_thread_list(self.target)?;
        let mut batch = self.sampler.plan_sample(self.target, self.tags, which);
        if let Err(e) = ThreadSampler::read_sample(self.target, &mut batch) {
            let called = self.sampler.discard(batch);
            // A stack may have moved away from where it was, a table may have been freed:
            // guess afresh next time.
            self.sampler.forget_stacks();
            self.tags.forget_tables();
            return self.thread_list_changed("reading threads", e, called);
        }
        let mut chosen = self.sampler.classify(self.target.layout, &batch, which);
        if let Err(e) = self
            .sampler
            .refresh_contexts(self.target, &mut batch, &chosen)
        {
            let called = self.sampler.discard(batch);
            return self.thread_list_changed("reading execution contexts", e, called);
        }
        // A thread that has not started running Ruby yet, or has finished, has no VM stack
        // (null `vm_stack` and `cfp`): it has nothing to sample, which is not a dropped sample.
        chosen.retain(|(i, _)| self.walker().ec_fields(&batch.heads[*i])[0] != 0);
        let (threads, failed) = self.walk_chosen(&mut batch, &chosen);
        self.sampler.chosen = chosen;
        let read_at = Some(self.sampler.discard(batch));
        let dropped = self.confirm_drops(failed?)?;
        Ok(Sample {
            read_at,
            threads,
            dropped,
            ractors: self.sampler.ractor_ids.clone(),
        })
    }

    /// A thread (or its context) went away while read: forget the list so the next sample
    /// reads it again, and report this sample as dropped (or the process as gone).
    fn thread_list_changed(
        &mut self,
        what: &str,
        e: MemoryError,
        called: Instant,
    ) -> Result<Sample> {
        self.sampler.read_at = None;
        self.sampler.forget_contexts();
        match self.target.moved(what)(e) {
            Attempt::Fatal(e) => Err(e),
            Attempt::Changed(_) => Ok(Sample {
                read_at: Some(called),
                ..Sample::dropped(Dropped::ThreadListChanged)
            }),
        }
    }

    /// One call for every chosen thread's frames (the prefetched ones mostly read already);
    /// a thread whose stack moved is retried alone. The threads sampled, and those whose
    /// stacks did not read (or the error that ends the sample).
    fn walk_chosen(
        &mut self,
        batch: &mut Batch,
        chosen: &[(usize, ThreadState)],
    ) -> (Vec<SampledThread>, Result<Vec<(u64, Dropped)>>) {
        let mut contexts = std::mem::take(&mut self.walk.contexts);
        contexts.clear();
        contexts.extend((chosen.iter()).map(|(i, _)| self.walker().ec_fields(&batch.heads[*i])));
        let reads = &batch.reads;
        let mut pre: Vec<Option<Prefetched>> = recycle(std::mem::take(&mut self.walk.prefetched));
        pre.extend(chosen.iter().map(|(i, _)| {
            batch.threads[*i].prefetch.map(|p| Prefetched {
                vm_stack: p.vm_stack,
                from: p.from,
                frames: reads.get(p.frames),
                values: reads.get(p.values),
            })
        }));
        // Tags before stacks: a table is trusted only when decoded within `TABLE_WINDOW` of
        // the batch's read, and walking every thread with cold caches (a process's first
        // sample) can take longer than that.
        let tags: Vec<Tags> = chosen
            .iter()
            .map(|(i, _)| self.thread_tags_of(batch, *i))
            .collect();
        let calls = self.target.mem.calls();
        let results = self.walker().walk_many(&contexts, pre);
        let walked_late = self.target.mem.calls() != calls;
        let results = self.confirm_tags(batch, chosen, results, walked_late);
        let mut sampled = Vec::with_capacity(chosen.len());
        let mut failed = Vec::new();
        let chosen = chosen.iter().copied().zip(tags);
        for ((((i, state), tags), ec), first) in chosen.zip(contexts.iter().copied()).zip(results) {
            let thread = self.sampler.threads[i].thread;
            let (stack, tags) = match self.retry_walk(thread, first, tags) {
                Ok(Retried::Walked(walked)) => walked,
                Ok(not_walked) => {
                    self.sampler.forget_stack(thread);
                    if let Retried::Moved(why) = not_walked {
                        failed.push((thread, why));
                    }
                    continue;
                }
                Err(e) => return (sampled, Err(e)),
            };
            let hints = &self.walk.stack_hints;
            self.sampler
                .guess_stack(self.target.layout, hints, thread, ec);
            sampled.push(SampledThread {
                info: self.sampler.threads[i].info.clone(),
                state,
                frames: stack.frames,
                stack_token: stack.token,
                tags,
            });
        }
        self.walk.contexts = contexts;
        (sampled, Ok(failed))
    }

    /// The tags of thread `i` of the batch, from what the batch read.
    fn thread_tags_of(&mut self, batch: &Batch, i: usize) -> Tags {
        let Some(read) = batch.threads[i].tag else {
            return Tags::default();
        };
        let thread = self.sampler.threads[i].thread;
        let nt = batch.nt(i, self.target.layout);
        let mut d = Decoder {
            target: self.target,
            cache: self.cache,
        };
        self.tags
            .sampled_tags(&mut d, thread, nt, read, &batch.reads, batch.called)
    }

    /// `results` with each walk whose tags may not be the ones its stack ran under turned into
    /// a change, for `retry_walk` to walk again between two readings of the tags. Within the
    /// batch's one call, the pointer is read before and after the thread's stack (the call
    /// copies in order, while the thread runs on), and must read the same. A walk that read
    /// frames of its own (`walked_late`: the guess of where the stack was fell short) saw the
    /// stack later than the batch saw the pointer, and a pointer read late saw it later than
    /// the stack. A thread that entered a request's action in between would show the action's
    /// stack without its tags (or left it, with the tags and another request's stack). So
    /// such a sample counts only if the pointer still holds the same table after the walk:
    /// one more call, only for samples that made calls of their own already. A pointer read
    /// apart from the batch (`tags_read_late`: a thread first seen, or another thread at a
    /// dead one's address) was read after the stack, which no later read can vouch for (a
    /// thread that left its tagged block and ends holds no table at both reads): such a
    /// sample is walked again between two readings of its tags.
    fn confirm_tags(
        &mut self,
        batch: &Batch,
        chosen: &[(usize, ThreadState)],
        mut results: Vec<std::result::Result<Stack, Attempt>>,
        walked_late: bool,
    ) -> Vec<std::result::Result<Stack, Attempt>> {
        // Tags that changed while the one call copied the stack, or were read after it.
        let l = self.target.layout;
        for (k, (i, _)) in chosen.iter().enumerate() {
            let held = batch.threads[*i].tag.is_none_or(|t| t.held(&batch.reads));
            if results[k].is_ok() && (!held || batch.tags_read_late(*i, l)) {
                results[k] = Err(Attempt::Changed(TAGS_CHANGED.into()));
            }
        }
        let check: Vec<(usize, (u64, u64, u64))> = chosen
            .iter()
            .enumerate()
            .filter(|(k, (i, _))| {
                results[*k].is_ok() && batch.threads[*i].tag.is_some() && walked_late
            })
            .map(|(k, (i, _))| {
                let thread = self.sampler.threads[*i].thread;
                let (table, record) = (
                    self.tags.sampled_table(thread),
                    self.tags.sampled_record(thread),
                );
                (k, (thread, table, record))
            })
            .collect();
        // Every thread's tags were read at the one published offset.
        let Some(offset) = check
            .first()
            .and_then(|(k, _)| batch.threads[chosen[*k].0].tag)
            .map(|read| read.offset)
        else {
            return results;
        };
        let pairs: Vec<(u64, u64, u64)> = check.iter().map(|(_, pair)| *pair).collect();
        let unchanged = self.tags.tables_unchanged(self.target, offset, &pairs);
        for ((k, _), same) in check.iter().zip(unchanged) {
            if !same {
                results[*k] = Err(Attempt::Changed(TAGS_CHANGED.into()));
            }
        }
        results
    }

    /// The stack from a thread's first walk, with `tags` (decoded from the batch), else from
    /// up to `THREAD_ATTEMPTS - 1` more walks of its own; `Moved` when it kept moving, and
    /// `Ended` when its context has no VM stack any more (a thread that finished since the
    /// batch: nothing to sample, as for one seen so in the batch). A walk of
    /// its own happens later than the batch, so its tags are read afresh around it and the
    /// walk counts only if they read the same before and after: a thread that moved on to
    /// another request meanwhile would otherwise show the new request's stack under the old
    /// one's tags, or under none. Its control frame pointer is read afresh too: frames above
    /// the one the batch saw stay in memory, unchanged, after the thread returns from them,
    /// so a walk from the batch's pointer would show a stack the thread has left (a thread
    /// that ended its tagged block was seen in it, untagged, at both readings).
    fn retry_walk(
        &mut self,
        thread: u64,
        first: std::result::Result<Stack, Attempt>,
        tags: Tags,
    ) -> Result<Retried> {
        let mut result = first.map(|stack| (stack, tags));
        for _ in 1..THREAD_ATTEMPTS {
            if !matches!(result, Err(Attempt::Changed(_))) {
                break;
            }
            self.walker().forget_envs();
            let before = self.thread_tags(thread);
            let ec = self.walker().read_ec_of(thread);
            if matches!(ec, Ok([0, _, _])) {
                return Ok(Retried::Ended);
            }
            result = ec.and_then(|ec| self.walker().walk(ec)).and_then(|stack| {
                let after = self.thread_tags(thread);
                if after == before {
                    Ok((stack, after))
                } else {
                    Err(Attempt::Changed(TAGS_CHANGED.into()))
                }
            });
        }
        match result {
            Ok(walked) => Ok(Retried::Walked(walked)),
            Err(Attempt::Fatal(e)) => Err(e),
            Err(Attempt::Changed(why)) if why == TAGS_CHANGED => {
                Ok(Retried::Moved(Dropped::TagsChanged))
            }
            Err(Attempt::Changed(_)) => Ok(Retried::Moved(Dropped::StackMoved)),
        }
    }

    /// The thread list is re-read every LIST_TTL, so a thread that ended since is still in
    /// it, and its freed memory may hold anything by now. A thread whose stack did not read
    /// is dropped only if a fresh list still has it; one that ended had nothing to sample.
    fn confirm_drops(&mut self, failed: Vec<(u64, Dropped)>) -> Result<Vec<Dropped>> {
        let mut dropped = Vec::new();
        if failed.is_empty() {
            return Ok(dropped);
        }
        self.sampler.read_at = None;
        self.sampler.fresh_thread_list(self.target)?;
        for (thread, why) in failed {
            if self.sampler.threads.iter().any(|t| t.thread == thread) {
                dropped.push(why);
            }
        }
        Ok(dropped)
    }
}
