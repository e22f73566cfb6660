# frozen_string_literal: true

require "fileutils"
require "json"
require "rbconfig"
require "rubygems/package"
require "tmpdir"
require_relative "../lib/rbspy_ext/version"

# The gems as users install them, into fresh GEM_HOMEs, checked through the installed copy
# only (no -Ilib, no RUBYLIB):
# - the source gem, which compiles with cargo (extconf.rb -> Makefile -> cargo build);
# - the x86_64-linux platform gem from `rake native` (pkg/, built by script/test before the
#   specs), on the host Ruby and inside the bullseye, trixie and sid chroots, with no cargo
#   and no C compiler on PATH;
# - the stub the source gem becomes where the spy cannot run;
# - the source gem where the toolchain is missing.
# How long installs took is printed at the end.
RSpec.describe "installing rbspy_ext", :slow do
  root = RubySpyTest::ROOT
  gi = RubySpyTest::GemInstall
  version = RubySpy::VERSION
  platform_gem = File.join(root, "pkg", "rbspy_ext-#{version}-x86_64-linux.gem")
  comparison = RubySpyTest::FrameComparison
  timings = []

  # Packs the source gem (once) into tmp/gem_install/.
  source_gem = lambda do
    @source_gem ||= begin
      out = File.join(root, "tmp", "gem_install", "rbspy_ext-#{version}.gem")
      FileUtils.mkdir_p(File.dirname(out))
      status, log = gi.run(["gem", "build", "rbspy_ext.gemspec", "--output", out], chdir: root,
                           log: "#{out}.log", timeout: 120)
      raise "gem build failed:\n#{log}" unless status.success?

      out
    end
  end

  # Starts the ground-truth target on +site+, snapshots it with the rbspy_ext installed in
  # +gem_home+ there, and returns [checker result, expected frames].
  snapshot_through = lambda do |site, site_dir, host_dir, gem_home|
    File.write(File.join(host_dir, "target.rb"), gi::TARGET)
    File.write(File.join(host_dir, "checker.rb"), gi::CHECKER)
    truth = File.join(host_dir, "truth.json")
    target = site.spawn_target(File.join(site_dir, "target.rb"), File.join(site_dir, "truth.json"))
    begin
      RubySpyTest::Waiting.wait_for("the target to be ready", timeout: 15, interval: 0.02) do
        next true if File.exist?(truth)

        raise "the target exited before it was ready" if Process.waitpid(target, Process::WNOHANG)
      end
      env = { "GEM_HOME" => gem_home, "GEM_PATH" => gem_home }
      status, out = gi.run(site.ruby(File.join(site_dir, "checker.rb"), target.to_s, env: env),
                           log: File.join(host_dir, "checker.log"), timeout: 60)
      raise "checker failed (#{status.inspect}):\n#{out}" unless status.success?

      [JSON.parse(out.lines.last), JSON.parse(File.read(truth))]
    ensure
      begin
        Process.kill("KILL", target)
        Process.wait(target)
      rescue Errno::ESRCH, Errno::ECHILD
        nil
      end
    end
  end

  to_frames = lambda do |rows, struct|
    rows.map { |r| struct.new(**r.transform_keys(&:to_sym).slice(*struct.members)) }
  end

  after(:context) do
    next if timings.empty?

    width = timings.map { |t| t[0].length }.max
    puts "\nInstall times (wall clock, this machine):"
    timings.each { |what, seconds| puts format("  %-#{width}s  %6.1f s", what, seconds) }
  end

  describe "the source gem" do
    before(:context) do
      @tmp = File.join(root, "tmp", "gem_install", "source")
      FileUtils.rm_rf(@tmp)
      FileUtils.mkdir_p(@tmp)
      @gem_home = File.join(@tmp, "gem_home")
      # What this checks is that the packed gem holds all it needs to build and load, not
      # how fast the build's code runs: cargo builds the dev profile (RB_SYS_CARGO_PROFILE,
      # which extconf.rb honours as rb_sys does) in script/test's target dir, where `cargo
      # test` has compiled every dependency in that profile, so only our crates are compiled
      # (some 20 s). In a target dir of its own, at opt-level 0, the dependencies took 3 min
      # on a fresh machine; optimised, our crates alone took 150 s of CPU on a machine CI
      # keeps busy, and `rake compile` builds the same sources optimised anyway.
      env = { "PATH" => "#{File.join(Dir.home, '.cargo', 'bin')}:/usr/sbin:/usr/bin:/sbin:/bin",
              "HOME" => Dir.home, "CARGO_TARGET_DIR" => ENV.fetch("CARGO_TARGET_DIR", File.join(root, "target")),
              "RB_SYS_CARGO_PROFILE" => "dev" }
      started = gi.monotonic
      status, out = gi.run(["gem", "install", "--local", "--no-document", "--install-dir", @gem_home,
                            source_gem.call], env: env, chdir: @tmp, log: File.join(@tmp, "install.log"),
                                              timeout: 30 * 60)
      timings << ["source gem, host Ruby #{RUBY_VERSION} (cargo build, dev profile, dependencies built)", gi.monotonic - started]
      raise "gem install failed:\n#{out}" unless status.success?

      @result, @truth = snapshot_through.call(gi::Site.new("host"), @tmp, @tmp, @gem_home)
    end

    it "loads the installed copy of the library and its compiled extension" do
      gem_dir = File.join(@gem_home, "gems", "rbspy_ext-#{version}")
      features = @result.fetch("features")
      expect(features).to include(File.join(gem_dir, "lib", "rbspy_ext.rb"))
      expect(features).to include(a_string_matching(%r{\A#{Regexp.escape(@gem_home)}/.*/rbspy_ext/rbspy_ext\.so\z}))
      expect(features).not_to include(a_string_starting_with(File.join(root, "lib", "")))
    end

    it "snapshots another process through the installed copy as Ruby lists its stack" do
      expect(@result["error"]).to be_nil
      actual = to_frames.call(@result.fetch("frames"), RubySpyTest::ExpectedFrame)
      expected = to_frames.call(@truth, RubySpyTest::ExpectedFrame)
      expect(comparison.problems(actual, expected, RUBY_VERSION)).to eq([]),
                                                                      comparison.side_by_side(actual, expected, RUBY_VERSION).to_s
    end
  end

  describe "the x86_64-linux platform gem" do
    # The series of the Rubies these machines have (Debian's four): a library for 3.0, 3.2
    # or 4.0 needs that Ruby to build against, which no registry here serves.
    let(:series) { %w[2.7 3.1 3.3 3.4] }

    before(:context) do
      raise "#{platform_gem} is missing: run rake native (script/test does)" unless File.file?(platform_gem)

      @package = Gem::Package.new(platform_gem)
      @spec = @package.spec
    end

    it "carries one library per Ruby series it can build for and nothing to compile" do
      libraries = @spec.files.grep(/\.so\z/)
      expect(libraries).to contain_exactly(*series.map { |s| "lib/rbspy_ext/#{s}/rbspy_ext.so" })
      expect(@spec.platform.to_s).to eq("x86_64-linux")
      expect(@spec.extensions).to be_empty
      expect(@spec.files.grep(%r{\A(?:ext|core|bindings)/|\ACargo\.})).to be_empty
      expect(@spec.executables).to eq(["rubyspy"])
    end

    it "admits exactly the Ruby series it carries" do
      requirement = @spec.required_ruby_version
      admitted = %w[2.7.0 2.7.4 2.7.8 3.1.0 3.1.2 3.1.7 3.3.0 3.3.8 3.4.0 3.4.5 3.4.11]
      # The series it carries no library for are the source gem's (RubyGems picks it there).
      refused = %w[2.6.10 3.0.0 3.0.7 3.2.0 3.2.11 4.0.0 4.0.2 4.1.0 4.1.0.dev 5.0.0]
      expect(admitted.reject { |v| requirement.satisfied_by?(Gem::Version.new(v)) }).to eq([])
      expect(refused.select { |v| requirement.satisfied_by?(Gem::Version.new(v)) }).to eq([])
    end

    it "needs no glibc newer than bullseye's 2.31 in any library" do
      Dir.mktmpdir("rbspy-native-") do |dir|
        @package.extract_files(dir)
        needs = Dir[File.join(dir, "lib/rbspy_ext/*/rbspy_ext.so")].to_h do |so|
          out = IO.popen(["readelf", "--version-info", "--wide", so], &:read)
          versions = out.scan(/Name: GLIBC_([\d.]+)/).flatten.map { |v| Gem::Version.new(v) }
          [File.basename(File.dirname(so)), versions.max]
        end
        expect(needs.keys).to contain_exactly(*series)
        expect(needs.values).to all(be <= Gem::Version.new("2.31"))
        puts "\nHighest glibc version needed: #{needs.map { |s, v| "#{s} GLIBC_#{v}" }.join(', ')}"
      end
    end

    # Debian's Rubies (a shared libruby) and the ones built as rbenv builds them (static: the
    # library finds Ruby's functions in the executable).
    built = IO.popen([File.join(RubySpyTest::ROOT, "script", "rubies"), "list"], &:read).lines.map { |l| l.split.first }
    %w[host bullseye trixie sid src-3.3 src-3.4].each do |name|
      it "installs without cargo or a C compiler, and snapshots a live process, on #{name}'s Ruby" do
        # script/test builds them first (its sources run) unless RUBYSPY_SKIP_MATRIX is set.
        skip "#{name} is not built here: script/rubies build #{name}" if name.start_with?("src-") && !built.include?(name)
        site = gi::Site.new(name)
        site_dir, host_dir = site.mktmpdir("rbspy-platform-")
        begin
          FileUtils.cp(platform_gem, host_dir)
          gem_home = File.join(site_dir, "gem_home")
          started = gi.monotonic
          status, out = gi.run(site.gem_install(File.join(site_dir, File.basename(platform_gem)), gem_home),
                               log: File.join(host_dir, "install.log"), timeout: 120)
          timings << ["platform gem, #{name} Ruby #{site.version} (no compiler)", gi.monotonic - started]
          expect(status).to be_success, out
          expect(Dir[File.join(host_dir, "gem_home/gems/rbspy_ext-#{version}-x86_64-linux")]).not_to be_empty

          result, truth = snapshot_through.call(site, site_dir, host_dir, gem_home)
          expect(result["error"]).to be_nil
          expect(result["features"]).to include(a_string_ending_with("/lib/rbspy_ext/#{site.series}/rbspy_ext.so"))
          actual = to_frames.call(result.fetch("frames"), RubySpyTest::ExpectedFrame)
          expected = to_frames.call(truth, RubySpyTest::ExpectedFrame)
          expect(comparison.problems(actual, expected, site.version)).to eq([]),
                                                                         comparison.side_by_side(actual, expected, site.version).to_s

          env = { "GEM_HOME" => gem_home, "GEM_PATH" => gem_home }
          status, out = gi.run(site.ruby(File.join(gem_home, "bin", "rubyspy"), "--help", env: env),
                               log: File.join(host_dir, "help.log"), timeout: 60)
          expect(status).to be_success, out
          expect(out).to include("Usage: rubyspy COMMAND")
        ensure
          FileUtils.rm_rf(host_dir)
        end
      end
    end

    it "is refused by the RubyGems of a Ruby whose series it carries no library for (the source gem serves it)" do
      other = IO.popen([File.join(RubySpyTest::ROOT, "script", "rubies"), "list"], &:read).lines.map(&:split)
                .find { |f| !series.include?(f[1][/\A\d+\.\d+/]) }
      skip "no Ruby here of a series the platform gem does not carry (4.0 or 4.1: RUBYSPY_EXTRA_RUBIES=/path/to/ruby)" unless other

      site = gi::Site.new(other[0])
      site_dir, host_dir = site.mktmpdir("rbspy-platform-")
      begin
        FileUtils.cp(platform_gem, host_dir)
        status, out = gi.run(site.gem_install(File.join(site_dir, File.basename(platform_gem)),
                                              File.join(site_dir, "gem_home")),
                             log: File.join(host_dir, "install.log"), timeout: 120)
        expect(status).not_to be_success
        expect(out).to match(/requires Ruby version/)
      ensure
        FileUtils.rm_rf(host_dir)
      end
    end

    context "installed on the host, then damaged" do
      around do |example|
        Dir.mktmpdir("rbspy-platform-") do |dir|
          @dir = dir
          @gem_home = File.join(dir, "gem_home")
          status, out = gi.run(gi::Site.new("host").gem_install(platform_gem, @gem_home),
                               log: File.join(dir, "install.log"), timeout: 120)
          raise "install failed:\n#{out}" unless status.success?

          @lib = File.join(@gem_home, "gems", "rbspy_ext-#{version}-x86_64-linux", "lib", "rbspy_ext")
          example.run
        end
      end

      let(:own) { File.join(@lib, RUBY_VERSION[/\A\d+\.\d+/], "rbspy_ext.so") }

      # `require "rbspy_ext"` in a fresh Ruby: [status, output].
      def require_installed
        env = { "GEM_HOME" => @gem_home, "GEM_PATH" => @gem_home }
        RubySpyTest::GemInstall.run(RubySpyTest::GemInstall::Site.new("host").ruby("-e", 'require "rbspy_ext"', env: env),
                                    log: File.join(@dir, "require.log"), timeout: 60)
      end

      it "without a library for this Ruby, raises a LoadError naming the series it has and the source gem" do
        FileUtils.rm_rf(File.dirname(own))
        status, out = require_installed
        expect(status.signaled?).to be(false)
        expect(status.exitstatus).to eq(1)
        carried = (series - [RUBY_VERSION[/\A\d+\.\d+/]]).join(", ")
        expect(out).to include("LoadError").and include("carries compiled extensions for Ruby #{carried}")
          .and include("not for Ruby #{RUBY_VERSION}").and include("gem install rbspy_ext --platform ruby")
      end

      it "with a truncated library, raises a LoadError naming the file" do
        File.truncate(own, 4096)
        status, out = require_installed
        expect(status.signaled?).to be(false)
        expect(out).to include("LoadError").and include("cannot load #{own}")
      end

      it "with another series' library in its place, raises a LoadError naming the file and both Rubies" do
        FileUtils.cp(File.join(@lib, "2.7", "rbspy_ext.so"), own)
        status, out = require_installed
        expect(status.signaled?).to be(false)
        expect(out).to include("LoadError").and include("cannot load #{own}")
          .and include("compiled for Ruby 2.7 and cannot run in Ruby #{RUBY_VERSION}")
      end
    end
  end

  describe "the stub, where the spy cannot run" do
    # Installs the source gem with +env+ (and +wrapper+ around `gem install`) into a fresh
    # GEM_HOME under +dir+; returns that GEM_HOME.
    install_stub = lambda do |dir, env: {}, wrapper: []|
      gem_home = File.join(dir, "gem_home")
      started = gi.monotonic
      # make runs even when there is nothing to build, so PATH has it (any real machine does).
      env = { "PATH" => "/usr/bin:/bin" }.merge(env)
      status, out = gi.run([*wrapper, *gi::Site.new("host").gem_install(source_gem.call, gem_home, env: env)],
                           log: File.join(dir, "install.log"), timeout: 120)
      raise "stub install failed:\n#{out}" unless status.success?

      timings << ["source gem as a stub (#{wrapper.empty? ? env.keys.last : wrapper.first}, nothing compiled)", gi.monotonic - started]
      make_out = Dir[File.join(gem_home, "extensions", "**", "gem_make.out")].map { |f| File.read(f) }.join
      raise "extconf did not choose the stub:\n#{make_out}" unless make_out.include?("rbspy_ext: installing without native code")
      raise "the stub installed native code" unless Dir[File.join(gem_home, "**", "*.so")].empty?

      gem_home
    end

    # What the installed stub does, as JSON from a fresh Ruby.
    probe = <<~'RUBY'
      require "json"
      require "rbspy_ext"
      out = { "tagged" => RubySpy.tag(request_id: "r1") { [RubySpy.tags, :ran] }, "tags" => RubySpy.tags }
      { "snapshot" => -> { RubySpy.snapshot(Process.pid) }, "attach" => -> { RubySpy.attach(1) },
        "record" => -> { RubySpy.record(Process.pid) { 1 } },
        "load" => -> { RubySpy::Profile.load(__FILE__) }, "heap" => -> { RubySpy.heap(Process.pid) },
        "census" => -> { RubySpy::Census.from_json('{"classes":[],"types":[]}').render(:text) } }.each do |what, call|
        call.call
        out[what] = "no error"
      rescue Exception => e
        out[what] = [e.class.name, e.is_a?(RubySpy::Error), e.message]
      end
      out["fiber"] = Fiber.new { RubySpy.tag(a: 1) { :fiber } }.resume
      puts JSON.generate(out)
    RUBY

    run_probe = lambda do |dir, gem_home|
      File.write(File.join(dir, "probe.rb"), probe)
      env = { "GEM_HOME" => gem_home, "GEM_PATH" => gem_home }
      status, out = gi.run(gi::Site.new("host").ruby(File.join(dir, "probe.rb"), env: env),
                           log: File.join(dir, "probe.log"), timeout: 60)
      raise "probe failed:\n#{out}" unless status.success?

      JSON.parse(out.lines.last)
    end

    it "installs with RBSPY_EXT_STUB=1 and loads: tag runs its block with no effect, the rest raise UnsupportedPlatform" do
      Dir.mktmpdir("rbspy-stub-") do |dir|
        result = run_probe.call(dir, install_stub.call(dir, env: { "RBSPY_EXT_STUB" => "1" }))
        expect(result["tagged"]).to eq([{}, "ran"])
        expect(result["tags"]).to eq({})
        expect(result["fiber"]).to eq("fiber")
        %w[snapshot attach record load heap census].each do |what|
          name, is_error, message = result.fetch(what)
          expect(name).to eq("RubySpy::UnsupportedPlatform"), "#{what}: #{result[what].inspect}"
          expect(is_error).to be(true)
          expect(message).to include(RUBY_PLATFORM).and include("RBSPY_EXT_STUB=1")
        end
      end
    end

    it "is what the source gem becomes on a kernel without process_vm_readv (ENOSYS, injected with strace)" do
      Dir.mktmpdir("rbspy-stub-") do |dir|
        wrapper = ["strace", "-f", "-qq", "-o", File::NULL, "-e", "trace=process_vm_readv",
                   "-e", "inject=process_vm_readv:error=ENOSYS"]
        result = run_probe.call(dir, install_stub.call(dir, wrapper: wrapper))
        expect(result.fetch("snapshot")[0]).to eq("RubySpy::UnsupportedPlatform")
        expect(result.fetch("snapshot")[2]).to include("no process_vm_readv (ENOSYS)")
      end
    end

    it "runs rubyspy --help, and fails its commands with the reason" do
      Dir.mktmpdir("rbspy-stub-") do |dir|
        gem_home = install_stub.call(dir, env: { "RBSPY_EXT_STUB" => "1" })
        env = { "GEM_HOME" => gem_home, "GEM_PATH" => gem_home }
        host = gi::Site.new("host")
        status, out = gi.run(host.ruby(File.join(gem_home, "bin", "rubyspy"), "--help", env: env),
                             log: File.join(dir, "help.log"), timeout: 60)
        expect(status).to be_success, out
        status, out = gi.run(host.ruby(File.join(gem_home, "bin", "rubyspy"), "snapshot", "--pid", "1", env: env),
                             log: File.join(dir, "snapshot.log"), timeout: 60)
        expect(status.exitstatus).to eq(1)
        expect(out).to include("rubyspy: rbspy_ext cannot read processes on #{RUBY_PLATFORM}")
      end
    end

    it "leaves an RSpec suite running unprofiled with one warning, and skips spend_at_most" do
      Dir.mktmpdir("rbspy-stub-") do |dir|
        gem_home = install_stub.call(dir, env: { "RBSPY_EXT_STUB" => "1" })
        project = File.join(dir, "project")
        FileUtils.mkdir_p(File.join(project, "spec"))
        File.write(File.join(project, "spec", "stub_check_spec.rb"), <<~'RUBY')
          require "rbspy_ext"
          RSpec.describe "under the stub" do
            it "runs a profiled example", :rubyspy do
              expect(RubySpy.tag(a: 1) { RubySpy.tags }).to eq({})
            end

            it "measures a share" do
              expect { 2 + 2 }.to spend_at_most(5).percent_in("x")
            end
          end
        RUBY
        # rspec itself comes from Debian's gems, the rest from the stub's GEM_HOME.
        env = { "GEM_HOME" => gem_home, "GEM_PATH" => [gem_home, *Gem.path].join(":"), "RUBYSPY" => "1" }
        rspec = Gem.bin_path("rspec-core", "rspec")
        status, out = gi.run(gi::Site.new("host").ruby(rspec, "--require", "rbspy_ext/rspec", env: env),
                             chdir: project, log: File.join(dir, "rspec.log"), timeout: 120)
        expect(status).to be_success, out
        expect(out).to include("2 examples, 0 failures, 1 pending")
        expect(out).to include("spend_at_most cannot measure on #{RUBY_PLATFORM}")
        expect(out.lines.grep(/\Arubyspy:/)).to eq(["rubyspy: not profiling: rbspy_ext cannot read processes on " \
                                                    "#{RUBY_PLATFORM} (it was installed with RBSPY_EXT_STUB=1)\n"])
        expect(File.exist?(File.join(project, "tmp"))).to be(false)
      end
    end
  end

  describe "the source gem without its toolchain" do
    message_lines = ->(out) { out.lines.grep(/rbspy_ext:|  - |precompiled/).join }

    it "fails on the host with one message naming cargo, the C compiler, libclang and Ruby's headers" do
      Dir.mktmpdir("rbspy-notools-") do |dir|
        # Ruby's headers hidden under empty tmpfs mounts in a private mount namespace; no cargo
        # on PATH or in HOME; CC and LIBCLANG_PATH pointing where nothing is.
        headers = RbConfig::CONFIG.values_at("rubyhdrdir", "rubyarchhdrdir")
        hide = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
                'for d in "$0" "$1"; do mount -t tmpfs none "$d" || exit 1; done; shift; exec "$@"', *headers]
        env = { "PATH" => "/usr/bin:/bin", "HOME" => dir, "CC" => "/nonexistent/cc", "LIBCLANG_PATH" => "/nonexistent" }
        status, out = gi.run([*hide, *gi::Site.new("host").gem_install(source_gem.call, File.join(dir, "gem_home"), env: env)],
                             log: File.join(dir, "install.log"), timeout: 120)
        expect(status).not_to be_success
        expect(out).to include("rbspy_ext: cannot compile its native extension for Ruby #{RUBY_VERSION}; missing:")
        expect(out).to include("cargo, Rust's build tool").and include("a C compiler (/nonexistent/cc")
          .and include("libclang, which reads Ruby's C headers (LIBCLANG_PATH=/nonexistent holds none)")
          .and include("the C headers of Ruby #{RUBY_VERSION}").and include("apt-get install ruby-dev")
          .and include("gem install rbspy_ext --platform x86_64-linux")
        expect(out).not_to match(/Compiling |error\[E|bindgen|panicked|can't find header/)
        puts "\nWhat `gem install` prints without a toolchain:\n#{message_lines.call(out)}"
      end
    end

    it "fails inside trixie (Ruby and ruby-dev, no Rust) naming cargo, and nothing compiles" do
      site = gi::Site.new("trixie")
      site_dir, host_dir = site.mktmpdir("rbspy-notools-")
      begin
        FileUtils.cp(source_gem.call, host_dir)
        status, out = gi.run(site.gem_install(File.join(site_dir, File.basename(source_gem.call)),
                                              File.join(site_dir, "gem_home"), env: { "PATH" => "/usr/bin:/bin" }),
                             log: File.join(host_dir, "install.log"), timeout: 120)
        expect(status).not_to be_success
        expect(out).to include("missing:").and include("cargo, Rust's build tool")
          .and include("gem install rbspy_ext --platform x86_64-linux")
        expect(out).not_to include("the C headers of Ruby")
        expect(out).not_to match(/Compiling |error\[E|bindgen|panicked/)
      ensure
        FileUtils.rm_rf(host_dir)
      end
    end
  end
end
