# frozen_string_literal: true

require "fileutils"
require "json"
require "rbconfig"
require_relative "../lib/rbspy_ext/version"

# Packs the gem, installs it as a user would (extconf.rb -> Makefile -> cargo build), and
# snapshots a live process through the installed copy only: no -Ilib, no RUBYLIB.
#
# The install compiles the extension; it shares cargo's target dir with the source tree
# (CARGO_TARGET_DIR, default <repo>/target) so dependencies are not rebuilt from zero. The
# work dir has a fixed path (tmp/gem_install, wiped first) because cargo keys the gem's own
# crates on their path: a new path each run would pile up copies of them in target/.
# KEEP_GEM_INSTALL_TMP=1 keeps the work dir for inspection.
RSpec.describe "the packaged gem", :slow do
  root = File.expand_path("..", __dir__)
  install_timeout = 30 * 60 # a cold cargo build on a small machine takes minutes
  start_timeout = 10

  # Environment for child Rubies: only the temp gem dir, nothing pointing into the repo.
  clean_env = lambda do |gem_home|
    { "GEM_HOME" => gem_home, "GEM_PATH" => gem_home, "RUBYLIB" => nil, "RUBYOPT" => nil,
      "BUNDLE_GEMFILE" => nil, "BUNDLE_BIN_PATH" => nil,
      "CARGO_TARGET_DIR" => ENV.fetch("CARGO_TARGET_DIR", File.join(root, "target")) }
  end

  monotonic = -> { Process.clock_gettime(Process::CLOCK_MONOTONIC) }

  # Runs +cmd+ with output to a log file, killing its process group after +timeout+ seconds.
  # Returns [Process::Status, output].
  run_logged = lambda do |env, cmd, chdir:, log:, timeout:|
    pid = Process.spawn(env, *cmd, chdir: chdir, out: log, err: %i[child out], pgroup: true)
    deadline = monotonic.call + timeout
    status = nil
    until (status = Process.waitpid2(pid, Process::WNOHANG)&.last)
      if monotonic.call > deadline
        Process.kill("KILL", -pid)
        Process.wait(pid)
        raise "#{cmd.join(' ')} timed out after #{timeout}s:\n#{File.read(log)}"
      end
      sleep 0.1 # polling interval
    end
    [status, File.read(log)]
  end

  # Prints, as JSON, what got loaded and the innermost frames of process ARGV[0]. The ready
  # file is written just before `sleep`, so a first snapshot can land in between: retry
  # until the target is inside sleep or the deadline passes.
  checker = <<~'RUBY'
    require "json"
    require "rbspy_ext"
    pid = Integer(ARGV[0])
    out = { "features" => $LOADED_FEATURES.grep(/rbspy_ext/) }
    deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + 10
    begin
      loop do
        frames = RubySpy.snapshot(pid)
        out["frames"] = frames.map(&:to_h)
        break if frames.first&.label == "Kernel#sleep"
        break if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline
      rescue RubySpy::StackChanged
        raise if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline
      end
    rescue Exception => e # report any failure (even NotImplementedError) as data
      out["error"] = "#{e.class}: #{e.message}"
    end
    puts JSON.generate(out)
  RUBY

  before(:context) do
    @tmp = File.join(root, "tmp", "gem_install")
    FileUtils.rm_rf(@tmp)
    FileUtils.mkdir_p(@tmp)
    @gem_home = File.join(@tmp, "gem_home")
    env = clean_env.call(@gem_home)
    gem_file = File.join(@tmp, "rbspy_ext-#{RubySpy::VERSION}.gem")

    status, out = run_logged.call(env, ["gem", "build", "rbspy_ext.gemspec", "--output", gem_file],
                                  chdir: root, log: File.join(@tmp, "build.log"), timeout: 120)
    raise "gem build failed:\n#{out}" unless status.success?

    status, out = run_logged.call(env, ["gem", "install", "--local", "--no-document",
                                        "--install-dir", @gem_home, "./#{File.basename(gem_file)}"],
                                  chdir: @tmp, log: File.join(@tmp, "install.log"),
                                  timeout: install_timeout)
    unless status.success?
      make_out = Dir[File.join(@gem_home, "extensions/**/gem_make.out")].map { |f| File.read(f) }
      raise "gem install failed:\n#{out}\n#{make_out.join("\n")}"
    end

    # The target: a script that announces itself, then sleeps until killed.
    @script = File.join(@tmp, "sleepy_target.rb")
    File.write(@script, "File.write(ARGV.fetch(0), Process.pid.to_s)\nsleep\n")
    ready = File.join(@tmp, "ready")
    target = Process.spawn(env, RbConfig.ruby, @script, ready, chdir: @tmp)
    begin
      deadline = monotonic.call + start_timeout
      until File.size?(ready)
        raise "target exited before it was ready" if Process.waitpid(target, Process::WNOHANG)
        raise "target not ready after #{start_timeout}s" if monotonic.call > deadline

        sleep 0.05 # polling interval
      end
      status, out = run_logged.call(env, [RbConfig.ruby, "-e", checker, target.to_s],
                                    chdir: @tmp, log: File.join(@tmp, "check.log"), timeout: 60)
      raise "checker failed:\n#{out}" unless status.success?

      @result = JSON.parse(out.lines.last)
    ensure
      begin
        Process.kill("KILL", target)
        Process.wait(target)
      rescue Errno::ESRCH, Errno::ECHILD
        nil
      end
    end
  end

  after(:context) do
    FileUtils.rm_rf(@tmp) if @tmp && !ENV["KEEP_GEM_INSTALL_TMP"]
  end

  it "loads the installed copy of the library and its compiled extension" do
    gem_dir = File.join(@gem_home, "gems", "rbspy_ext-#{RubySpy::VERSION}")
    features = @result.fetch("features")

    expect(features).to include(File.join(gem_dir, "lib", "rbspy_ext.rb"))
    expect(features).to include(a_string_matching(%r{\A#{Regexp.escape(@gem_home)}/.*/rbspy_ext/rbspy_ext\.so\z}))
    expect(features).not_to include(a_string_starting_with(File.join(root, "lib", "")))
  end

  it "snapshots another process through the installed copy" do
    expect(@result["error"]).to be_nil
    innermost = @result.fetch("frames").first
    expect(innermost).to include("label" => "Kernel#sleep")
    expect(innermost.fetch("path")).to end_with(File.basename(@script))
  end
end
