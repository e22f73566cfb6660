# frozen_string_literal: true

# Writes the Makefile that builds the Rust extension and installs it as
# rbspy_ext/rbspy_ext.so (lib/rbspy_ext/native.rb finds it there).
#
# Before anything is compiled it decides two things, in plain Ruby (mkmf itself aborts when
# Ruby's headers are missing, with a message about those alone):
# - Where the spy cannot run (not Linux, a kernel without process_vm_readv, or
#   RBSPY_EXT_STUB=1 at install time, which makes this path testable on Linux), it compiles
#   nothing: the Makefile installs rbspy_ext/unsupported_platform.rb, which holds the reason,
#   and the gem loads inert stand-ins (lib/rbspy_ext/unsupported.rb). `gem install` and the
#   application's boot succeed.
# - Where it can run but cargo, a C compiler, libclang or Ruby's headers are missing, it stops
#   with one message naming each and how to install it, instead of cargo's or bindgen's output.
#
# With the rb_sys gem available we hand over to its create_rust_makefile. Debian's packaged
# Ruby has neither rb_sys nor rake-compiler, so otherwise we write a small Makefile that
# drives cargo directly and speaks the make protocol RubyGems' ExtConfBuilder uses:
# `make clean`, `make`, `make install` (with `DESTDIR=` and sitearchdir pointed at a
# temporary directory through a siteconf file; RubyGems then copies what was installed there
# into the gem's lib/ and its extension dir).

require "rbconfig"

# The checks, kept apart from the Makefile writing below.
module RbspyExtConf
  # What a user who cannot compile installs instead (on the platforms rake native builds for).
  PRECOMPILED = "gem install rbspy_ext --platform x86_64-linux"

  module_function

  # Why the spy cannot run here, or nil.
  def unsupported_reason
    switch = ENV.fetch("RBSPY_EXT_STUB", "")
    return "it was installed with RBSPY_EXT_STUB=#{switch}" unless ["", "0"].include?(switch)
    unless RbConfig::CONFIG.fetch("host_os").include?("linux")
      return "it reads process memory with Linux's process_vm_readv, and this is " \
             "#{RbConfig::CONFIG.fetch('host_os')}"
    end

    process_vm_readv_missing
  end

  # Reads 8 bytes of this very process with process_vm_readv, through Fiddle (no compiler
  # needed yet). Only ENOSYS (a kernel built without it) or a C library without the function
  # means the spy cannot run here; anything else, or no Fiddle, is left for run time to tell,
  # since the machine that installs is not always the one that runs (a seccomp policy of a
  # build container says nothing about production).
  def process_vm_readv_missing
    require "fiddle"
    fn = begin
      Fiddle::Handle::DEFAULT["process_vm_readv"]
    rescue Fiddle::DLError
      return "the C library has no process_vm_readv"
    end
    bytes = 8
    source = Fiddle::Pointer.malloc(bytes)
    dest = Fiddle::Pointer.malloc(bytes)
    iov = ->(buf) { Fiddle::Pointer[[buf.to_i, bytes].pack("J2")] }
    local = iov.call(dest)
    remote = iov.call(source)
    # Unsigned longs passed as longs: older Fiddles have no TYPE_ULONG, and the values are small.
    call = Fiddle::Function.new(fn, [Fiddle::TYPE_INT, Fiddle::TYPE_VOIDP, Fiddle::TYPE_LONG,
                                     Fiddle::TYPE_VOIDP, Fiddle::TYPE_LONG, Fiddle::TYPE_LONG],
                                Fiddle::TYPE_LONG)
    return nil if call.call(Process.pid, local, 1, remote, 1, 0) == bytes
    return nil unless Fiddle.last_error == Errno::ENOSYS::Errno

    "this kernel has no process_vm_readv (ENOSYS)"
  rescue LoadError, StandardError
    nil
  end

  # One line per missing piece of the toolchain, saying how to get it.
  def missing_tools
    missing = []
    missing << "cargo, Rust's build tool: install Rust with https://rustup.rs" unless cargo
    cc = ENV.fetch("CC", "cc").split.first
    unless executable(cc) && executable("cc")
      missing << "a C compiler (#{cc}; rustc links with cc): Debian/Ubuntu apt-get install gcc, " \
                 "Fedora dnf install gcc, Alpine apk add build-base"
    end
    unless libclang
      where = ENV["LIBCLANG_PATH"] ? " (LIBCLANG_PATH=#{ENV['LIBCLANG_PATH']} holds none)" : ""
      missing << "libclang, which reads Ruby's C headers#{where}: Debian/Ubuntu apt-get install " \
                 "libclang-dev, Fedora dnf install clang-devel, Alpine apk add clang-dev; or set " \
                 "LIBCLANG_PATH to the directory holding libclang.so"
    end
    unless headers?
      missing << "the C headers of Ruby #{RUBY_VERSION} (no #{File.join(RbConfig::CONFIG['rubyhdrdir'], 'ruby.h')}): " \
                 "Debian/Ubuntu apt-get install ruby-dev (or ruby#{RUBY_VERSION[/\A\d+\.\d+/]}-dev), " \
                 "Fedora dnf install ruby-devel"
    end
    missing
  end

  # What building the BPF sampler (`record --bpf`) needs and this machine lacks: clang to
  # compile core/bpf/sampler.bpf.c, and the headers of the kernel, libelf and zlib for
  # libbpf. Without them the gem is built without it, and --bpf says so.
  def bpf_missing
    missing = []
    missing << "clang" unless executable(ENV.fetch("CLANG", "clang"))
    includes = ["/usr/include", "/usr/local/include"]
    { "linux/bpf.h" => "linux-libc-dev", "libelf.h" => "libelf-dev", "zlib.h" => "zlib1g-dev" }.each do |h, pkg|
      missing << "#{h} (#{pkg})" unless includes.any? { |d| File.exist?(File.join(d, h)) }
    end
    missing
  end

  # The cargo to build with: $CARGO, cargo on PATH, or rustup's default place (which
  # non-login shells often leave off PATH).
  def cargo
    [ENV.fetch("CARGO", nil), executable("cargo"), File.join(Dir.home, ".cargo", "bin", "cargo")]
      .compact.find { |c| File.file?(c) && File.executable?(c) }
  rescue ArgumentError # no home directory
    executable("cargo")
  end

  def executable(name)
    return name if name.include?("/") && File.executable?(name)

    ENV.fetch("PATH", "").split(File::PATH_SEPARATOR).map { |d| File.join(d, name) }
       .find { |f| File.file?(f) && File.executable?(f) }
  end

  # Where clang-sys (bindgen's loader) looks: only LIBCLANG_PATH when it is set, otherwise
  # llvm-config's prefix, LD_LIBRARY_PATH and the usual library directories.
  def libclang
    names = ["libclang.so", "libclang-*.so", "libclang.so.*", "libclang-*.so.*"]
    dirs = if ENV["LIBCLANG_PATH"]
             path = ENV["LIBCLANG_PATH"]
             return path if File.file?(path) && File.basename(path).start_with?("libclang")

             [path]
           else
             prefix = begin
               `llvm-config --prefix 2>/dev/null`.strip
             rescue SystemCallError
               ""
             end
             [*(%w[lib lib64].map { |d| File.join(prefix, d) } unless prefix.empty?),
              *ENV.fetch("LD_LIBRARY_PATH", "").split(":").reject(&:empty?),
              *Dir["/usr/lib/llvm*/lib", "/usr/lib64/llvm*/lib", "/usr/local/llvm*/lib", "/opt/llvm*/lib"],
              "/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/local/lib64", *Dir["/usr/lib/*-linux-*"]]
           end
    dirs.flat_map { |d| names.flat_map { |n| Dir[File.join(d, n)] } }.first
  end

  def headers?
    File.file?(File.join(RbConfig::CONFIG.fetch("rubyhdrdir"), "ruby.h")) &&
      File.file?(File.join(RbConfig::CONFIG.fetch("rubyarchhdrdir"), "ruby", "config.h"))
  end
end

# The siteconf RubyGems passes makes sitearchdir a path relative to this directory; mkmf
# prefixes it with $(DESTDIR) the same way.
sitearchdir = RbConfig::CONFIG.fetch("sitearchdir")

if (reason = RbspyExtConf.unsupported_reason)
  File.write("unsupported_platform.rb", <<~RUBY)
    # frozen_string_literal: true

    # Written by rbspy_ext's extconf.rb, which compiled nothing: the spy cannot run here.
    RubySpy::Native::UNSUPPORTED_REASON = #{reason.dump}
  RUBY
  File.write("Makefile", <<~MAKE)
    # Generated by #{File.expand_path(__FILE__)}: nothing to compile (#{reason}).
    SHELL = /bin/sh
    DESTDIR =
    sitearchdir = $(DESTDIR)#{sitearchdir}
    RUBYARCHDIR = $(sitearchdir)/rbspy_ext

    all:

    install:
    	mkdir -p $(RUBYARCHDIR)
    	cp unsupported_platform.rb $(RUBYARCHDIR)/unsupported_platform.rb

    clean:

    distclean:
    	rm -f Makefile unsupported_platform.rb

    .PHONY: all install clean distclean
  MAKE
  puts "rbspy_ext: installing without native code: #{reason}"
  exit
end

missing = RbspyExtConf.missing_tools
unless missing.empty?
  abort(<<~MESSAGE)
    rbspy_ext: cannot compile its native extension for Ruby #{RUBY_VERSION}; missing:
    #{missing.map { |m| "  - #{m}" }.join("\n")}
    On x86_64 Linux the precompiled gem needs none of these: #{RbspyExtConf::PRECOMPILED}
  MESSAGE
end

bpf_missing = RbspyExtConf.bpf_missing
features = ""
unless bpf_missing.empty?
  features = "--no-default-features"
  puts "rbspy_ext: building without the BPF sampler (record --bpf): missing #{bpf_missing.join(', ')}; " \
       "Debian/Ubuntu: apt-get install clang libelf-dev zlib1g-dev"
end

# The cargo profile, read as rb_sys reads it, for either path below: release unless
# RB_SYS_CARGO_PROFILE names another (dev, or one of Cargo.toml's). spec/gem_install_spec.rb
# builds the source gem in dev, where `cargo test` has already compiled every dependency.
profile = ENV.fetch("RB_SYS_CARGO_PROFILE", "release")
unless profile.match?(/\A[a-z0-9_-]+\z/)
  abort "rbspy_ext: RB_SYS_CARGO_PROFILE=#{profile.inspect} is not a cargo profile name (release, dev, ...)"
end

require "mkmf" # first: rake-compiler and rb_sys hook into it

begin
  require "rb_sys/mkmf"
rescue LoadError
  nil
end

if defined?(RbSys::Mkmf)
  create_rust_makefile("rbspy_ext/rbspy_ext") do |r|
    r.profile = profile.to_sym
    r.extra_cargo_args += [features] unless features.empty?
  end
  exit
end

# The cargo workspace (Cargo.toml, Cargo.lock, core/, bindings/, ext/rbspy_ext/) sits two
# levels up, both in the source tree and in an unpacked gem.
workspace = File.expand_path("../..", __dir__)
target_dir = ENV.fetch("CARGO_TARGET_DIR", File.join(workspace, "target"))
# In an installed gem (no .git) with the default target dir, drop cargo's build tree once the
# library is installed (plus the build copy of the .so): it is several hundred MB and is
# never reused there.
clean_target = !ENV.key?("CARGO_TARGET_DIR") && !File.exist?(File.join(workspace, ".git"))
# Cargo puts the dev profile's output in debug/, every other profile's in a directory of its name.
profile_dir = profile == "dev" ? "debug" : profile

File.write("Makefile", <<~MAKE)
  # Generated by #{File.expand_path(__FILE__)} (no rb_sys gem found). Drives cargo directly.
  SHELL = /bin/sh
  DESTDIR =
  sitearchdir = $(DESTDIR)#{sitearchdir}
  target_prefix = /rbspy_ext
  RUBYARCHDIR = $(sitearchdir)$(target_prefix)
  DLLIB = rbspy_ext.#{RbConfig::CONFIG.fetch("DLEXT")}
  WORKSPACE = #{workspace}
  # Both can be overridden from the environment at make time.
  CARGO ?= #{RbspyExtConf.cargo}
  CARGO_TARGET_DIR ?= #{target_dir}
  CLEAN_TARGET_AFTER_INSTALL = #{clean_target ? "yes" : "no"}
  RUSTLIB = $(CARGO_TARGET_DIR)/#{profile_dir}/librbspy_ext.#{RbConfig::CONFIG.fetch("SOEXT")}
  # rb-sys's build script asks this Ruby for its headers and configuration.
  export RUBY = #{RbConfig.ruby}
  export CARGO_TARGET_DIR

  all: $(DLLIB)

  # Always ask cargo: it knows whether anything changed, make does not. Without this make's
  # MAKEFLAGS: RubyGems runs `make DESTDIR=`, and the empty DESTDIR would reach the make that
  # libbpf-sys runs to build libbpf (for the BPF sampler), whose install step then fails.
  # Without SOURCE_DATE_EPOCH, which RubyGems sets to the time of each install: the C
  # compiler's build scripts (cc) watch it, so with a shared CARGO_TARGET_DIR every install,
  # and the next build from the source tree, built libbpf and its crates again (2 min).
  # Nothing here uses __DATE__ or __TIME__, which is all it would change.
  $(DLLIB): FORCE
  \tenv -u MAKEFLAGS -u MFLAGS -u MAKELEVEL -u SOURCE_DATE_EPOCH $(CARGO) build --profile #{profile} --manifest-path $(WORKSPACE)/Cargo.toml --package rbspy_ext #{features}
  \tcp -f $(RUSTLIB) $@

  install: all
  \tmkdir -p $(RUBYARCHDIR)
  \tinstall -m 0755 $(DLLIB) $(RUBYARCHDIR)/$(DLLIB)
  ifeq ($(CLEAN_TARGET_AFTER_INSTALL),yes)
  \trm -rf $(CARGO_TARGET_DIR) $(DLLIB)
  endif

  # Leaves cargo's build cache alone: rebuilding it from nothing takes minutes.
  clean:
  \trm -f $(DLLIB)

  distclean: clean
  \trm -f Makefile

  FORCE:
  .PHONY: all install clean distclean FORCE
MAKE

puts "creating Makefile (cargo, target dir #{target_dir})"
