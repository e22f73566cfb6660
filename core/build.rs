//! With the `bpf` feature (the default), compiles core/bpf/sampler.bpf.c with clang into a
//! BPF object and generates its libbpf skeleton (core/src/bpf/mod.rs includes it). Without
//! the feature there is nothing to build: the BPF sampler then reports itself unavailable.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "bpf")]
    bpf::build();
}

#[cfg(feature = "bpf")]
mod bpf {
    use std::path::PathBuf;

    pub fn build() {
        for f in ["bpf/sampler.bpf.c", "bpf/sampler.h"] {
            println!("cargo:rerun-if-changed={f}");
        }
        let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
        // libbpf's own headers (bpf_helpers.h, bpf_core_read.h), from the libbpf that
        // libbpf-sys builds: they match the library we link, whatever the system has.
        let libbpf = std::env::var("DEP_BPF_INCLUDE").expect("libbpf-sys exports its include dir");
        let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
        // The kernel's UAPI headers (linux/bpf.h) include <asm/types.h>, which Debian keeps
        // under the multiarch directory.
        let multiarch = format!("/usr/include/{arch}-linux-gnu");
        let mut args = vec![format!("-I{libbpf}"), format!("-I{multiarch}")];
        if arch == "x86_64" {
            args.push("-D__TARGET_ARCH_x86".into());
        }
        let result = libbpf_cargo::SkeletonBuilder::new()
            .source("bpf/sampler.bpf.c")
            .obj(out.join("sampler.bpf.o"))
            .clang_args(args)
            .build_and_generate(out.join("sampler.skel.rs"));
        if let Err(e) = result {
            panic!(
                "building the BPF sampler (core/bpf/sampler.bpf.c) failed: {e:#}\n\
                 It needs clang and the kernel's headers (Debian: apt-get install clang \
                 linux-libc-dev libelf-dev zlib1g-dev), or build without it: \
                 cargo build --no-default-features"
            );
        }
    }
}
