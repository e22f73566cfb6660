//! Every Ruby thread of the target, for the recorder: the thread list, each thread's
//! identity (native tid, `Thread#name`), its state, and its stack.
//!
//! A child module of `spy` so that it shares the walker's private machinery.
use super::batch::{Batch, ThreadSampler};
use super::tags::Decoder;
use super::{Attempt, Memory, Prefetched, Spy, Stack};
use crate::error::{Error, Result};
use crate::model::{SampledThread, ThreadSelection, ThreadState};

/// How often one thread's walk is retried when its stack moves while read.
const THREAD_ATTEMPTS: u32 = 2;

impl<M: Memory> Spy<M> {
    /// One sample of the selected threads: each thread's state and stack. Threads whose
    /// stack moved while read are left out and reported in the second list (by reason);
    /// nothing is ever invented.
    pub fn sample_threads(
        &mut self,
        which: ThreadSelection,
    ) -> Result<(Vec<SampledThread>, Vec<&'static str>)> {
        self.target.check_identity(false)?;
        match self.sample_threads_once(which) {
            // A failed read may be the process gone or replaced (see `check_identity`).
            Err(e) if !matches!(e, Error::PermissionDenied { .. }) => {
                self.target.check_identity(true)?;
                Err(e)
            }
            result => result,
        }
    }

    fn sample_threads_once(
        &mut self,
        which: ThreadSelection,
    ) -> Result<(Vec<SampledThread>, Vec<&'static str>)> {
        self.fresh_thread_list()?;
        let mut batch = self
            .sampler
            .plan_sample(&self.target, &mut self.tags, which);
        if let Err(e) = ThreadSampler::read_sample(&self.target, &mut batch) {
            self.sampler.discard(batch);
            // A stack may have moved away from where it was, a table may have been freed:
            // guess afresh next time.
            self.sampler.forget_stacks();
            self.tags.forget_tables();
            return self.thread_list_changed("reading threads", e);
        }
        let mut chosen = self.sampler.classify(self.target.layout, &batch, which);
        if let Err(e) = self
            .sampler
            .refresh_contexts(&self.target, &mut batch, &chosen)
        {
            self.sampler.discard(batch);
            return self.thread_list_changed("reading execution contexts", e);
        }
        // A thread that has not started running Ruby yet, or has finished, has no VM stack
        // (null `vm_stack` and `cfp`): it has nothing to sample, which is not a dropped sample.
        chosen.retain(|(i, _)| self.ec_fields(&batch.heads[*i])[0] != 0);
        let (sampled, failed) = self.walk_chosen(&mut batch, chosen);
        self.sampler.discard(batch);
        let dropped = self.confirm_drops(failed?)?;
        Ok((sampled, dropped))
    }

    /// Forgets what is known of each thread (the list, contexts, stacks, tag pointers), and
    /// keeps what describes code (iseqs, method entries, names, the memo): for a spy kept
    /// between recordings, whose threads may have come and gone meanwhile.
    pub fn forget_threads(&mut self) {
        self.sampler.read_at = None;
        self.sampler.forget_stacks();
        self.sampler.forget_contexts();
        self.tags.forget_threads();
    }

    /// A thread (or its context) went away while read: forget the list so the next sample
    /// reads it again, and report this sample as dropped (or the process as gone).
    #[allow(clippy::type_complexity)]
    fn thread_list_changed(
        &mut self,
        what: &str,
        e: crate::error::MemoryError,
    ) -> Result<(Vec<SampledThread>, Vec<&'static str>)> {
        self.sampler.read_at = None;
        self.sampler.forget_contexts();
        match self.moved(what)(e) {
            Attempt::Fatal(e) => Err(e),
            Attempt::Changed(_) => Ok((Vec::new(), vec!["thread list changed"])),
        }
    }

    /// One call for every chosen thread's frames (the prefetched ones mostly read already);
    /// a thread whose stack moved is retried alone. The threads sampled, and those whose
    /// stacks did not read (or the error that ends the sample).
    #[allow(clippy::type_complexity)]
    fn walk_chosen(
        &mut self,
        batch: &mut Batch,
        chosen: Vec<(usize, ThreadState)>,
    ) -> (Vec<SampledThread>, Result<Vec<u64>>) {
        let contexts: Vec<[u64; 3]> = chosen
            .iter()
            .map(|(i, _)| self.ec_fields(&batch.heads[*i]))
            .collect();
        let reads = &batch.reads;
        let pre: Vec<Option<Prefetched>> = chosen
            .iter()
            .map(|(i, _)| {
                batch.threads[*i].prefetch.map(|p| Prefetched {
                    vm_stack: p.vm_stack,
                    from: p.from,
                    frames: reads.get(p.frames),
                    values: reads.get(p.values),
                })
            })
            .collect();
        // Tags before stacks: a table is trusted only when decoded within `TABLE_WINDOW` of
        // the batch's read, and walking every thread with cold caches (a process's first
        // sample) can take longer than that.
        let tags: Vec<super::Tags> = chosen
            .iter()
            .map(|(i, _)| self.thread_tags_of(batch, *i))
            .collect();
        let calls = self.target.mem.calls();
        let results = self.walk_many(&contexts, pre);
        let walked_late = self.target.mem.calls() != calls;
        let results = self.confirm_tags(batch, &chosen, results, walked_late);
        let mut sampled = Vec::with_capacity(chosen.len());
        let mut failed = Vec::new();
        let chosen = chosen.into_iter().zip(tags);
        for ((((i, state), tags), ec), first) in chosen.zip(contexts).zip(results) {
            let thread = self.sampler.threads[i].thread;
            let (stack, tags) = match self.retry_walk(thread, first, tags) {
                Ok(Some(walked)) => walked,
                Ok(None) => {
                    self.sampler.forget_stack(thread);
                    failed.push(thread);
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
        (sampled, Ok(failed))
    }

    /// The tags of thread `i` of the batch, from what the batch read.
    fn thread_tags_of(&mut self, batch: &Batch, i: usize) -> super::Tags {
        let Some(read) = batch.threads[i].tag else {
            return super::Tags::default();
        };
        let thread = self.sampler.threads[i].thread;
        let nt = batch.nt(i, self.target.layout);
        let mut d = Decoder {
            target: &self.target,
            cache: &mut self.cache,
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
                results[k] = Err(Attempt::Changed("tags changed while read".into()));
            }
        }
        let check: Vec<(usize, (u64, u64))> = chosen
            .iter()
            .enumerate()
            .filter(|(k, (i, _))| {
                results[*k].is_ok() && batch.threads[*i].tag.is_some() && walked_late
            })
            .map(|(k, (i, _))| {
                let thread = self.sampler.threads[*i].thread;
                (k, (thread, self.tags.sampled_table(thread)))
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
        let pairs: Vec<(u64, u64)> = check.iter().map(|(_, pair)| *pair).collect();
        let unchanged = self.tags.tables_unchanged(&self.target, offset, &pairs);
        for ((k, _), same) in check.iter().zip(unchanged) {
            if !same {
                results[*k] = Err(Attempt::Changed("tags changed while read".into()));
            }
        }
        results
    }

    /// The stack from a thread's first walk, with `tags` (decoded from the batch), else from
    /// up to `THREAD_ATTEMPTS - 1` more walks of its own; None when it kept moving. A walk of
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
        tags: super::Tags,
    ) -> Result<Option<(Stack, super::Tags)>> {
        let mut result = first.map(|stack| (stack, tags));
        for _ in 1..THREAD_ATTEMPTS {
            if !matches!(result, Err(Attempt::Changed(_))) {
                break;
            }
            self.forget_envs();
            let before = self.thread_tags(thread);
            result = self
                .read_ec_of(thread)
                .and_then(|ec| self.walk(ec))
                .and_then(|stack| {
                    let after = self.thread_tags(thread);
                    if after == before {
                        Ok((stack, after))
                    } else {
                        Err(Attempt::Changed("tags changed while read".into()))
                    }
                });
        }
        match result {
            Ok(walked) => Ok(Some(walked)),
            Err(Attempt::Fatal(e)) => Err(e),
            Err(Attempt::Changed(_)) => Ok(None),
        }
    }

    /// The thread list is re-read every LIST_TTL, so a thread that ended since is still in
    /// it, and its freed memory may hold anything by now. A thread whose stack did not read
    /// is dropped only if a fresh list still has it; one that ended had nothing to sample.
    fn confirm_drops(&mut self, failed: Vec<u64>) -> Result<Vec<&'static str>> {
        let mut dropped = Vec::new();
        if failed.is_empty() {
            return Ok(dropped);
        }
        self.sampler.read_at = None;
        self.fresh_thread_list()?;
        for thread in failed {
            if self.sampler.threads.iter().any(|t| t.thread == thread) {
                dropped.push("stack changed while read");
            }
        }
        Ok(dropped)
    }
}
