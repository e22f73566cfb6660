// SPDX-License-Identifier: MIT OR GPL-2.0
// The record sampler.bpf.c writes into the ring buffer. core/src/bpf/record.rs reads it
// with the same layout (its tests check the sizes against these numbers).
#ifndef RBSPY_EXT_SAMPLER_H
#define RBSPY_EXT_SAMPLER_H

/* Bytes of control frames copied: 512 frames of 64 bytes (the depth cap user space states
 * is max_frame_bytes / cfp_size, at most this). A power of two: indexes are masked by it. */
#define MAX_FRAME_BYTES (512 * 64)
/* Bytes of value stack copied, from just above the innermost frame's environment down: 512
 * frames of up to 32 words (receiver, arguments, locals, environment). */
#define MAX_VALUE_BYTES (128 * 1024)
/* Slots of a tag table copied (a table of 64 slots holds up to 32 tags), and the room the
 * record keeps for one: a header and 64 slots of two words each, as
 * core/src/context/profiler_state.rs lays a table out (a unit test there checks this). */
#define MAX_TAG_SLOTS 64
#define MAX_TAG_BYTES ((2 + 2 * MAX_TAG_SLOTS) * 8)
/* Bytes of an OpenTelemetry thread context record copied (OTEP 4947's limit, the room the
 * record keeps: core/src/context/otel_thread.rs, MAX_RECORD_LEN). */
#define MAX_OTEL_BYTES 640
#define MAX_THREADS 8192

#define FLAG_TRUNCATED 1  /* deeper than max_frame_bytes: the outermost frames are cut */
#define FLAG_UNREADABLE 2 /* the context or its frames did not read */
#define FLAG_VALUES_CUT 4 /* the value stack was longer than MAX_VALUE_BYTES */
#define FLAG_TAGS_CUT 8   /* a tag table larger than MAX_TAG_SLOTS */
#define FLAG_UNKNOWN 16   /* a thread of the target not in the thread map: a header alone */
#define FLAG_OTEL_UNREAD 32 /* an OpenTelemetry record that did not read, or said it was longer than MAX_OTEL_BYTES */

#define COUNT_UNKNOWN_THREAD 0
#define COUNT_RING_FULL 1
#define COUNTERS 2

struct header {
    __u64 time_ns;      /* bpf_ktime_get_ns (CLOCK_MONOTONIC) */
    __u32 tid;
    __u32 flags;
    __u64 thread;       /* rb_thread_t * */
    __u64 ec;           /* its rb_execution_context_t * */
    __u64 head[3];      /* ec->vm_stack, ec->vm_stack_size, ec->cfp */
    __u64 gvl_owner;    /* the rb_thread_t * holding the GVL (0: none) */
    __u32 gc_flags;     /* rb_objspace.flags */
    __u32 frame_bytes;  /* control frames from cfp, data[0..frame_bytes) */
    __u64 values_from;  /* address of the value stack copy */
    __u32 value_bytes;  /* data[frame_bytes..+value_bytes) */
    __u32 tag_words;    /* the table's words (size, capacity, pairs) after the values */
    __u64 tag_table;    /* the ruby_profiler_state pointer */
    __u64 otel_record;  /* the otel_thread_ctx_v1 pointer */
    __u32 otel_bytes;   /* the record's bytes after the table's words */
    __u32 pad;
};

/* A Ruby thread in the program's thread map. */
struct ruby_thread {
    __u64 thread;    /* rb_thread_t * */
    __u32 tid;       /* its native tid, 0 when the Ruby version keeps none (2.7) */
    __u32 pad;
    __u64 gvl_owner; /* the word naming its Ractor's GVL holder (each Ractor has a GVL) */
};

struct record {
    struct header h;
    __u8 data[MAX_FRAME_BYTES + MAX_VALUE_BYTES + MAX_TAG_BYTES + MAX_OTEL_BYTES];
};

#endif
