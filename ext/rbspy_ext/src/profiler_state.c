/*
 * The `ruby_profiler_state` ABI: a thread-local pointer to the current fiber's context
 * table, in the published, BPF-friendly layout (see docs/profiler-state.md). Written in C
 * because stable Rust cannot define an exported thread-local symbol; everything else about
 * the table (building it, keeping its values alive, following fibers) is in state.rs.
 */
#include <stddef.h>

struct Ruby_Profiler_Pair {
    unsigned long key;   /* ID; 0 marks an empty slot */
    unsigned long value; /* VALUE */
};

struct Ruby_Profiler_State {
    size_t size;     /* pairs in use */
    size_t capacity; /* slots, a power of two */
    struct Ruby_Profiler_Pair pairs[];
};

/*
 * initial-exec: the pointer sits in the static TLS block at one fixed offset from every
 * thread's thread pointer, so a reader outside the process (a BPF program, our sampler)
 * finds it as `*(thread pointer + ruby_profiler_state_tp_offset)` with no DTV walk. A
 * dlopen'ed library may use initial-exec for a few bytes: glibc reserves static TLS
 * surplus for exactly this.
 */
__attribute__((visibility("default"), tls_model("initial-exec")))
_Thread_local struct Ruby_Profiler_State *ruby_profiler_state = NULL;

/*
 * Published for readers outside the process: the offset of `ruby_profiler_state` from the
 * thread pointer (x86_64: %fs base, equal to pthread_self(); aarch64: TPIDR_EL0), in bytes.
 * 0 until the extension is initialised. Not thread-local, so it can be read through the
 * .so's symbol table and the process's memory alone.
 */
__attribute__((visibility("default"))) volatile long ruby_profiler_state_tp_offset = 0;

/*
 * Not part of the published ABI, an addition of rbspy_ext's: the Ruby thread (its
 * `rb_thread_t *`) whose current fiber's table `ruby_profiler_state` holds on this native
 * thread. With M:N threads (Ruby 3.3+, RUBY_MN_THREADS=1) Ruby threads take turns on native
 * threads, and between a thread being put on a native thread and its resume hook updating
 * the pointer, the pointer is still the previous thread's; a reader that knows which Ruby
 * thread it reads for compares this first. Same placement and publication as above.
 */
__attribute__((visibility("default"), tls_model("initial-exec")))
_Thread_local void *ruby_profiler_state_owner = NULL;
__attribute__((visibility("default"))) volatile long ruby_profiler_state_owner_tp_offset = 0;

/*
 * OpenTelemetry's thread context (OTEP 4947): a pointer to the current fiber's context
 * record (core/src/context/otel_thread.rs: trace-id, span-id, valid, trace-flags,
 * attrs-data-size, attributes), NULL when its fiber works for no trace and has no tags.
 * Exported in .dynsym under the name the OTEP gives, for any reader that knows the OTEP.
 * initial-exec, like ruby_profiler_state: the OTEP lets readers meet any static model, and
 * rbspy_ext's own reader finds it as `*(thread pointer + otel_thread_ctx_v1_tp_offset)`.
 * It is switched with ruby_profiler_state, under the same owner word, and a record is
 * never changed once published: a new context is a new record (the OTEP's "swap the
 * pointer" way; `valid` is always 1).
 */
__attribute__((visibility("default"), tls_model("initial-exec")))
_Thread_local void *otel_thread_ctx_v1 = NULL;
__attribute__((visibility("default"))) volatile long otel_thread_ctx_v1_tp_offset = 0;

/* The version of this ABI (the layout above and the reading procedure); bumped only if
 * either ever changes. */
__attribute__((visibility("default"))) const unsigned long ruby_profiler_state_abi_version = 1;

static char *thread_pointer(void) {
    char *tp;
#if defined(__x86_64__)
    __asm__("mov %%fs:0, %0" : "=r"(tp)); /* the TCB's self pointer */
#elif defined(__aarch64__)
    __asm__("mrs %0, tpidr_el0" : "=r"(tp));
#else
#error "rbspy_ext: publishing ruby_profiler_state needs the thread pointer of this architecture"
#endif
    return tp;
}

long rbspy_ext_state_init(void) {
    otel_thread_ctx_v1_tp_offset = (long)((char *)&otel_thread_ctx_v1 - thread_pointer());
    ruby_profiler_state_owner_tp_offset =
        (long)((char *)&ruby_profiler_state_owner - thread_pointer());
    ruby_profiler_state_tp_offset = (long)((char *)&ruby_profiler_state - thread_pointer());
    return ruby_profiler_state_tp_offset;
}

/*
 * The `RubySpy::State` object whose table this native thread publishes (0 for none): private,
 * so state.rs learns which table stops being published here and can keep it alive a while
 * for readers that read the pointer just before it changed.
 */
__attribute__((tls_model("initial-exec"))) static __thread unsigned long published_object = 0;

/*
 * Publishes `state` and `record` (the table and the OpenTelemetry record of the State object
 * `object`, or NULL, NULL and 0) for the Ruby thread `owner`, and returns the State object
 * published here until now.
 *
 * Like a seqlock with the owner as its sequence: the owner is cleared, then the table
 * stored, then the owner set, each store ordered after the one before for any observer. A
 * reader reads the owner, the table, then the owner again, and takes the table only when
 * both owner reads name its thread: a table stored between them would have cleared the
 * owner first. (Reading the owner once is not enough: it can be the old thread's while
 * the table read after it is already the new thread's.)
 */
unsigned long rbspy_ext_state_set(struct Ruby_Profiler_State *state, void *record, void *owner,
                                  unsigned long object) {
    unsigned long previous = published_object;
    /* Already published (a fiber switch between fibers with the same tags, a resumed 1:1
     * thread): no store, so a reader never sees the owner cleared while the table stays. */
    if (previous == object && ruby_profiler_state == state && otel_thread_ctx_v1 == record &&
        ruby_profiler_state_owner == owner)
        return previous;
    published_object = object;
    __atomic_store_n(&ruby_profiler_state_owner, (void *)0, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&ruby_profiler_state, state, __ATOMIC_RELAXED);
    __atomic_store_n(&otel_thread_ctx_v1, record, __ATOMIC_RELAXED);
    __atomic_store_n(&ruby_profiler_state_owner, owner, __ATOMIC_RELEASE);
    return previous;
}

void *rbspy_ext_otel_get(void) {
    return otel_thread_ctx_v1;
}

struct Ruby_Profiler_State *rbspy_ext_state_get(void) {
    return ruby_profiler_state;
}
