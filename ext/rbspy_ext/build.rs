//! Compiles the C half of the `ruby_profiler_state` ABI (an exported thread-local symbol,
//! which stable Rust cannot define) and makes the linker export its symbols from the
//! extension: rustc's version script exports only Rust items, and a second anonymous
//! version script is merged with it.
//!
//! It also turns the Ruby version being built for into `ruby_gte_X_Y` cfgs (rb-sys-env), for
//! the C API that only newer Rubies have (the thread event hook of 3.3+, state.rs), and into
//! `RBSPY_EXT_RUBY_SERIES` ("3.1"), which the extension checks against the Ruby loading it.
fn main() {
    // rb-sys's build script publishes the Ruby it builds for; without it (no Ruby) the cfgs
    // are simply absent and the 3.3+ code is left out.
    match rb_sys_env::activate() {
        Ok(env) => {
            let (major, minor) = env.ruby_major_minor();
            println!("cargo:rustc-env=RBSPY_EXT_RUBY_SERIES={major}.{minor}");
        }
        Err(e) => {
            println!("cargo:warning=rbspy_ext: no Ruby version cfgs: {e}");
            println!("cargo:rustc-env=RBSPY_EXT_RUBY_SERIES=unknown");
        }
    }
    cc::Build::new()
        .file("src/profiler_state.c")
        .flag_if_supported("-std=c11")
        .compile("rbspy_ext_profiler_state");
    // The linker reads a copy in OUT_DIR: a shared target directory (~/.cache/rbspy_ext)
    // keeps this script's output from one checkout for another, and a path into a clone
    // that was since deleted (a CI run's) failed the link.
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    std::fs::copy("exports.map", format!("{out}/exports.map")).expect("copy exports.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={out}/exports.map");
    println!("cargo:rerun-if-changed=src/profiler_state.c");
    println!("cargo:rerun-if-changed=exports.map");
}
