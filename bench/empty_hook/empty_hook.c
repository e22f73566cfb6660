/*
 * For bench/tags.rb only: a RUBY_EVENT_FIBER_SWITCH hook that does nothing, installed the
 * same way rbspy_ext installs its own (SAFE | RAW_ARG). What a fiber switch costs with it is
 * the floor any fiber-switch hook pays for Ruby calling it, before the hook does any work.
 */
#include <ruby.h>
#include <ruby/debug.h>

static void empty_hook(VALUE data, void *trace_arg) {
    (void)data;
    (void)trace_arg;
}

static VALUE install(VALUE self) {
    (void)self;
    rb_add_event_hook2((rb_event_hook_func_t)empty_hook, RUBY_EVENT_FIBER_SWITCH, Qnil,
                       RUBY_EVENT_HOOK_FLAG_SAFE | RUBY_EVENT_HOOK_FLAG_RAW_ARG);
    return Qnil;
}

void Init_empty_hook(void) {
    rb_define_module_function(rb_define_module("EmptyFiberSwitchHook"), "install", install, 0);
}
