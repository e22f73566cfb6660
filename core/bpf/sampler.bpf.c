// SPDX-License-Identifier: MIT OR GPL-2.0
// rbspy_ext's in-kernel sampler (core/src/bpf/): on each perf_event CPU-clock tick, for a
// thread of the target process, copies what the user-space walker needs to resolve the
// Ruby thread's stack, all read in this one pass while the thread is stopped on this CPU:
//   - the execution context's stack fields (vm_stack, vm_stack_size, cfp);
//   - the control frames from cfp towards the end of the VM stack (at most MAX_FRAMES);
//   - the used top of the value stack, where those frames' environments live;
//   - the GVL owner and the GC's flags (the thread's state);
//   - the thread's ruby_profiler_state table, header and slots (docs/profiler-state.md).
// Nothing is symbolised here: user space resolves the raw frames through the same walker
// and caches that make snapshots exact (spy/captured.rs). It only reads user memory
// (bpf_probe_read_user), never writes it.
//
// Every layout offset is a read-only global set from the target's `Layout` before load, so
// one object file serves every Ruby version. No vmlinux.h: the one kernel field read
// (task->thread.fsbase, the thread pointer on x86-64) is declared below and relocated by
// libbpf against the running kernel's BTF (CO-RE).
#include <linux/bpf.h>
#include <linux/types.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#include "sampler.h"

struct thread_struct {
    unsigned long fsbase;
} __attribute__((preserve_access_index));

struct task_struct {
    struct thread_struct thread;
} __attribute__((preserve_access_index));

/* The interrupted thread's thread pointer (x86-64: %fs base; glibc's pthread_self()). Other
 * architectures are not supported yet: there it is 0, which finds no thread. */
static __always_inline __u64 thread_pointer(void)
{
#if defined(__TARGET_ARCH_x86)
    struct task_struct *task = (struct task_struct *)bpf_get_current_task_btf();
    return BPF_CORE_READ(task, thread.fsbase);
#else
    return 0;
#endif
}

const volatile __u32 target_tgid = 0;
/* The PID namespace target_tgid is a pid of (the loader's): its device and inode. */
const volatile __u64 pidns_dev = 0;
const volatile __u64 pidns_ino = 0;
const volatile __u64 thread_ec = 0;
/* th->nt and nt->thread_id (3.2+; 0 before): see the check in rbspy_sample. */
const volatile __u64 thread_nt = 0;
const volatile __u64 nt_thread_id = 0;
const volatile __u64 ec_vm_stack = 0; /* vm_stack, vm_stack_size and cfp follow it */
const volatile __u64 cfp_size = 64;
const volatile __u64 cfp_sp = 8;
const volatile __u64 cfp_ep = 32;
const volatile __u64 max_frame_bytes = 512 * 64;
const volatile __u64 gvl_owner_addr = 0;
const volatile __u64 gc_flags_addr = 0;
/* Offset of ruby_profiler_state from the thread pointer; 0: the target has no tags. */
const volatile __s64 tag_offset = 0;
/* Under M:N threads: the offset of Ruby's own `ruby_current_ec` thread-local from the thread
 * pointer, and ec->thread_ptr. Set, the running Ruby thread is the one whose context the
 * ticked native thread names now (Ruby sets it on every switch), and the thread map is keyed
 * by rb_thread_t * instead of by thread pointer. 0: the map's thread pointer decides. */
const volatile __s64 ec_tls_offset = 0;
const volatile __u64 ec_thread_ptr = 0;
/* Offset of ruby_profiler_state_owner (docs/profiler-state.md), 0 when unknown: the Ruby
 * thread whose table the native thread's pointer holds. Under M:N it lags a switch until the
 * resumed thread's hook runs; a table whose owner is not the sampled thread is not copied. */
const volatile __s64 tag_owner_offset = 0;
/* The table's layout, set by user space from core/src/context/profiler_state.rs (its one
 * home): bytes of the header (size, capacity) and of a slot (ID, VALUE). */
const volatile __u64 tag_header_len = 16;
const volatile __u64 tag_pair_len = 16;
/* Offset of otel_thread_ctx_v1 (OpenTelemetry's thread context) from the thread pointer, 0
 * when the target has none; and its record's layout from core/src/context/otel_thread.rs:
 * the head's length and where in it attrs-data-size (u16) is. */
const volatile __s64 otel_offset = 0;
const volatile __u64 otel_head_len = 28;
const volatile __u64 otel_attrs_size_at = 26;

/* Thread pointer (glibc's pthread_t) -> rb_thread_t *, filled by user space from the thread
 * list. Keyed by thread pointer rather than tid: every Ruby from 2.7 on keeps the pthread_t
 * of its threads (Ruby 2.7 keeps no tid). */
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, MAX_THREADS);
    __type(key, __u64);
    __type(value, struct ruby_thread);
} threads SEC(".maps");

/* One record buffer per CPU (a per-CPU array value is limited to 32 KB; this is a plain
 * array indexed by CPU, sized by user space to the number of possible CPUs). A perf_event
 * program runs with preemption off, so the CPU's buffer is its own until it returns. */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, struct record);
} scratch SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_RINGBUF);
    __uint(max_entries, 1 << 23);
} events SEC(".maps");

/* Ticks of target threads that are not Ruby threads we know, and records the ring buffer
 * had no room for: counted, so user space can report them rather than lose them silently. */
struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, COUNTERS);
    __type(key, __u32);
    __type(value, __u64);
} counters SEC(".maps");

static __always_inline void count(__u32 which)
{
    __u64 *n = bpf_map_lookup_elem(&counters, &which);
    if (n)
        *n += 1;
}

/* The name `bpftool prog show` lists (core/src/bpf/mod.rs, PROGRAM). */
SEC("perf_event")
int rbspy_sample(void *ctx)
{
    /* Pids as the loader sees them, which in a container differ from the kernel's own. */
    struct bpf_pidns_info ns = {0, 0};
    if (bpf_get_ns_current_pid_tgid(pidns_dev, pidns_ino, &ns, sizeof ns) || ns.tgid != target_tgid)
        return 0;
    __u32 tid = ns.pid;
    __u64 tp = thread_pointer();
    __u64 key = tp, running_ec = 0;
    if (ec_tls_offset) {
        /* 0: this native thread runs no Ruby thread now (an idle shared native thread, the
         * timer thread): not a sample. */
        if (bpf_probe_read_user(&running_ec, 8, (void *)(tp + ec_tls_offset)) || !running_ec) {
            count(COUNT_UNKNOWN_THREAD);
            return 0;
        }
        key = 0;
        bpf_probe_read_user(&key, 8, (void *)(running_ec + ec_thread_ptr));
    }
    struct ruby_thread *thread = bpf_map_lookup_elem(&threads, &key);
    /* glibc reuses a finished thread's stack, and with it its thread pointer: a new thread
     * may have a dead one's until user space refreshes the map. The tid tells them apart. */
    if (thread && !ec_tls_offset && thread->tid && thread->tid != tid)
        thread = 0;
    /* Under M:N threads (a non-main Ractor's from 3.3) Ruby threads take turns on shared
     * native threads, and a thread that leaves one has its nt cleared: the thread the map
     * names must still run on this native thread, or this tick is another thread's, which
     * user space learns of (and refreshes the map) as for an unknown thread. */
    if (thread && thread_nt && !ec_tls_offset) {
        __u64 nt = 0, runs_on = 0;
        bpf_probe_read_user(&nt, 8, (void *)(thread->thread + thread_nt));
        if (nt)
            bpf_probe_read_user(&runs_on, 8, (void *)(nt + nt_thread_id));
        if (runs_on != tp)
            thread = 0;
    }
    __u32 cpu = bpf_get_smp_processor_id();
    struct record *r = bpf_map_lookup_elem(&scratch, &cpu);
    if (!r)
        return 0;
    struct header *h = &r->h;
    h->time_ns = bpf_ktime_get_ns();
    h->tid = tid;
    if (!thread) {
        /* A native thread that runs no Ruby, or a Ruby thread started since user space last
         * filled the map: the header tells user space which, through its tid. */
        count(COUNT_UNKNOWN_THREAD);
        __builtin_memset((char *)h + 16, 0, sizeof(*h) - 16);
        h->flags = FLAG_UNKNOWN;
        if (bpf_ringbuf_output(&events, h, sizeof(*h), BPF_RB_NO_WAKEUP))
            count(COUNT_RING_FULL);
        return 0;
    }
    h->flags = 0;
    h->thread = thread->thread;
    h->ec = 0;
    h->head[0] = h->head[1] = h->head[2] = 0;
    h->gvl_owner = 0;
    h->gc_flags = 0;
    h->frame_bytes = 0;
    h->value_bytes = 0;
    h->values_from = 0;
    h->tag_table = 0;
    h->tag_words = 0;
    h->otel_record = 0;
    h->otel_bytes = 0;
    h->pad = 0;

    if (running_ec)
        h->ec = running_ec;
    else if (bpf_probe_read_user(&h->ec, 8, (void *)(h->thread + thread_ec)))
        h->flags |= FLAG_UNREADABLE;
    if (bpf_probe_read_user(h->head, sizeof h->head, (void *)(h->ec + ec_vm_stack)))
        h->flags |= FLAG_UNREADABLE;
    /* The thread's own Ractor's GVL; the main Ractor's when user space gave none. */
    __u64 owner_addr = thread->gvl_owner ? thread->gvl_owner : gvl_owner_addr;
    if (owner_addr)
        bpf_probe_read_user(&h->gvl_owner, 8, (void *)owner_addr);
    if (gc_flags_addr)
        bpf_probe_read_user(&h->gc_flags, 4, (void *)gc_flags_addr);

    __u64 vm_stack = h->head[0], cfp = h->head[2];
    /* The last control frame slot is a dummy that Ruby's own backtrace skips. */
    __u64 end = vm_stack + h->head[1] * 8 - cfp_size;
    __u64 frames = 0;
    if (!(h->flags & FLAG_UNREADABLE) && vm_stack && cfp >= vm_stack && cfp < end) {
        frames = end - cfp;
        if (frames > max_frame_bytes) {
            frames = max_frame_bytes;
            h->flags |= FLAG_TRUNCATED;
        }
    }
    if (frames > MAX_FRAME_BYTES)
        frames = MAX_FRAME_BYTES;
    if (frames && bpf_probe_read_user(r->data, frames, (void *)cfp) == 0)
        h->frame_bytes = frames;
    else if (frames)
        h->flags |= FLAG_UNREADABLE;

    /* The value stack up to the innermost frame's sp (or just past its environment, if sp
     * lags): every running frame's environment lies below it. */
    __u64 top = 0, ep = 0;
    if (h->frame_bytes) {
        __u64 sp_at = cfp_sp & (MAX_FRAME_BYTES - 8), ep_at = cfp_ep & (MAX_FRAME_BYTES - 8);
        top = *(__u64 *)(r->data + sp_at);
        ep = *(__u64 *)(r->data + ep_at) + 8;
        if (ep > top)
            top = ep;
        if (top > cfp || top < vm_stack)
            top = 0;
    }
    __u64 from = vm_stack;
    if (top && top - from > MAX_VALUE_BYTES) {
        from = top - MAX_VALUE_BYTES;
        h->flags |= FLAG_VALUES_CUT;
    }
    __u64 values = top ? top - from : 0;
    __u64 at = h->frame_bytes;
    if (at > MAX_FRAME_BYTES)
        at = MAX_FRAME_BYTES;
    if (values > MAX_VALUE_BYTES)
        values = MAX_VALUE_BYTES;
    if (values && bpf_probe_read_user(r->data + at, values, (void *)from) == 0) {
        h->value_bytes = values;
        h->values_from = from;
    }

    /* The tags: the table pointer at the thread pointer + offset, then its header and
     * slots in one read, copied into the record (a table may be freed 10 ms after it is
     * unpublished, long before user space reads the ring). */
    __u64 owner = h->thread;
    if (tag_offset && tag_owner_offset)
        bpf_probe_read_user(&owner, 8, (void *)(tp + tag_owner_offset));
    if (tag_offset && owner == h->thread) {
        __u64 table = 0;
        bpf_probe_read_user(&table, 8, (void *)(tp + tag_offset));
        h->tag_table = table;
        __u64 hdr[2] = {0, 0};
        if (table && bpf_probe_read_user(hdr, sizeof hdr, (void *)table) == 0) {
            if (hdr[1] > MAX_TAG_SLOTS || hdr[0] > hdr[1]) {
                h->flags |= FLAG_TAGS_CUT;
            } else {
                __u64 t = at + h->value_bytes;
                if (t > MAX_FRAME_BYTES + MAX_VALUE_BYTES)
                    t = MAX_FRAME_BYTES + MAX_VALUE_BYTES;
                __u64 bytes = tag_header_len + tag_pair_len * hdr[1];
                if (bytes > MAX_TAG_BYTES)
                    bytes = MAX_TAG_BYTES;
                if (bytes && bpf_probe_read_user(r->data + t, bytes, (void *)table) == 0)
                    h->tag_words = bytes / 8;
            }
        }
    }

    /* The OpenTelemetry record, under the same owner: its head, then the whole record (at
     * most MAX_OTEL_BYTES), copied after the table's words. */
    if (otel_offset && owner == h->thread) {
        __u64 rec = 0;
        bpf_probe_read_user(&rec, 8, (void *)(tp + otel_offset));
        h->otel_record = rec;
        __u8 head[32] = {};
        __u64 head_len = otel_head_len;
        if (head_len > sizeof head)
            head_len = sizeof head;
        if (rec && otel_attrs_size_at + 2 <= head_len &&
            bpf_probe_read_user(head, head_len, (void *)rec) == 0) {
            /* attrs-data-size, host order (little-endian: the thread pointer is read as
             * %fs base, x86-64 only). */
            __u64 size_at = otel_attrs_size_at & 31;
            __u64 attrs = head[size_at] | ((__u64)head[(size_at + 1) & 31] << 8);
            __u64 bytes = head_len + attrs;
            __u64 t = at + h->value_bytes + h->tag_words * 8;
            if (t > MAX_FRAME_BYTES + MAX_VALUE_BYTES + MAX_TAG_BYTES)
                t = MAX_FRAME_BYTES + MAX_VALUE_BYTES + MAX_TAG_BYTES;
            if (bytes > MAX_OTEL_BYTES) {
                h->flags |= FLAG_OTEL_UNREAD;
            } else if (bpf_probe_read_user(r->data + t, bytes, (void *)rec) == 0) {
                h->otel_bytes = bytes;
            } else {
                h->flags |= FLAG_OTEL_UNREAD;
            }
        } else if (rec) {
            h->flags |= FLAG_OTEL_UNREAD;
        }
    }

    __u64 size = sizeof(struct header) + h->frame_bytes + h->value_bytes + h->tag_words * 8 +
                 h->otel_bytes;
    if (size > sizeof(struct record))
        size = sizeof(struct record);
    /* No wake-up: user space drains the ring on its own schedule (core/src/bpf/mod.rs). */
    if (bpf_ringbuf_output(&events, r, size, BPF_RB_NO_WAKEUP))
        count(COUNT_RING_FULL);
    return 0;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
