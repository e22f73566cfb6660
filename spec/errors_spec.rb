# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "etc"
require "open3"
require "shellwords"

RSpec.describe "RubySpy errors" do
  # An error whose class is one of +classes+ and whose message names +pid+.
  def an_error_naming(pid, *classes)
    satisfy("be a #{classes.join(" or ")} naming pid #{pid}") do |e|
      classes.any? { |c| e.is_a?(c) } && e.message.match?(/(?<!\d)#{pid}(?!\d)/)
    end
  end

  def expect_unharmed(target)
    expect(target.health_problems).to eq([]), "the target was harmed by the attempt"
  end

  describe "argument checking" do
    ["123", nil, 1.5].each do |bad|
      it "raises TypeError for #{bad.inspect}" do
        expect { RubySpy.snapshot(bad) }.to raise_error(TypeError)
        expect { RubySpy.attach(bad) }.to raise_error(TypeError)
      end
    end

    [0, -5].each do |bad|
      it "raises ArgumentError for #{bad}" do
        expect { RubySpy.snapshot(bad) }.to raise_error(ArgumentError, /#{bad}/)
        expect { RubySpy.attach(bad) }.to raise_error(ArgumentError, /#{bad}/)
      end
    end
  end

  it "derives every RubySpy error from RubySpy::Error, a StandardError" do
    classes = [RubySpy::NoSuchProcess, RubySpy::PermissionDenied, RubySpy::NotRubyProcess,
               RubySpy::UnsupportedVersion, RubySpy::ProcessExited, RubySpy::StackChanged,
               RubySpy::CorruptMemory]
    expect(classes).to all(be < RubySpy::Error)
    expect(RubySpy::Error).to be < StandardError
  end

  describe RubySpy::NoSuchProcess do
    it "is raised for a pid above the kernel's pid_max" do
      pid = Integer(File.read("/proc/sys/kernel/pid_max")) + 1

      expect { RubySpy.snapshot(pid) }.to raise_error(an_error_naming(pid, RubySpy::NoSuchProcess))
    end

    it "is raised for the pid of a process that exited and was reaped" do
      pid = Process.spawn("true")
      Process.wait(pid)
      skip "pid #{pid} was reused already" if File.exist?("/proc/#{pid}")

      expect { RubySpy.snapshot(pid) }.to raise_error(an_error_naming(pid, RubySpy::NoSuchProcess))
    end
  end

  describe RubySpy::NotRubyProcess do
    let(:sleep_binary) do
      dir = ENV.fetch("PATH", "/usr/bin:/bin").split(File::PATH_SEPARATOR)
               .find { |d| File.executable?(File.join(d, "sleep")) }
      dir ? File.realpath(File.join(dir, "sleep")) : skip("no sleep executable on PATH")
    end

    it "is raised for a process running another program, which keeps running" do
      pid = Process.spawn(sleep_binary, "100", out: File::NULL, err: File::NULL)
      begin
        # Until exec completes the child is still a copy of this Ruby process.
        wait_for("#{pid} to exec #{sleep_binary}", timeout: 15) do
          (File.readlink("/proc/#{pid}/exe") rescue nil) == sleep_binary
        end

        expect { RubySpy.snapshot(pid) }.to raise_error(an_error_naming(pid, RubySpy::NotRubyProcess))
        expect { RubySpy.attach(pid) }.to raise_error(RubySpy::NotRubyProcess)
        expect(RubySpyTest.process_problems(pid)).to eq([])
      ensure
        Process.kill(:KILL, pid)
        Process.wait(pid)
      end
    end
  end

  describe RubySpy::PermissionDenied do
    # A command prefix that runs its argument vector as nobody, with no supplementary groups
    # and (having left uid 0) no capabilities.
    def as_nobody
      nobody = Etc.getpwnam("nobody")
      if system("setpriv", "--version", out: File::NULL, err: File::NULL)
        ->(argv) { ["setpriv", "--reuid=#{nobody.uid}", "--regid=#{nobody.gid}", "--clear-groups", "--"] + argv }
      elsif system("su", "--version", out: File::NULL, err: File::NULL)
        ->(argv) { ["su", "-s", "/bin/sh", "nobody", "-c", Shellwords.join(argv)] }
      end
    rescue ArgumentError # no such user
      nil
    end

    # lib/ copied where nobody can read it (the checkout may sit below a private directory).
    def world_readable_lib
      dir = Dir.mktmpdir("rbspy-lib-")
      @cleanup_dirs << dir
      FileUtils.cp_r(File.join(RubySpyTest::ROOT, "lib", "."), dir)
      FileUtils.chmod_R("a+rX", dir)
      dir
    end

    before { @cleanup_dirs = [] }
    after { @cleanup_dirs.each { |d| FileUtils.rm_rf(d) } }

    it "is raised, with advice, to a reader that may not ptrace the target" do
      skip "must run as root to start a reader as another user" unless Process.uid.zero?
      runner = as_nobody or skip "neither setpriv nor su is available (or no user nobody)"
      whoami, = Open3.capture2(*runner.call(["id", "-u"]))
      skip "could not switch to nobody (id -u said #{whoami.inspect})" unless whoami.strip == Etc.getpwnam("nobody").uid.to_s

      target = start_target("responder", stdio: true)
      lib = world_readable_lib
      script = 'require "rbspy_ext"; RubySpy.snapshot(Integer(ARGV.fetch(0)))'
      out, err, status = Open3.capture3(*runner.call([RbConfig.ruby, "-I", lib, "-e", script,
                                                      target.pid.to_s]), chdir: lib)

      report = "exit: #{status.inspect}\nstdout: #{out}\nstderr: #{err}"
      expect(status).not_to be_success, report
      expect(err).to include("RubySpy::PermissionDenied"), report
      expect(err).to match(/(?<!\d)#{target.pid}(?!\d)/), report
      expect(err).to include("CAP_SYS_PTRACE"), report
      expect(err).to include("ptrace_scope"), report
      expect_unharmed(target)
    end

    it "rubyspy snapshot and record as nobody against a root process: exit 1, one line with the hint" do
      skip "must run as root to start a reader as another user" unless Process.uid.zero?
      runner = as_nobody or skip "neither setpriv nor su is available (or no user nobody)"

      target = start_target("responder", stdio: true)
      # exe/rubyspy loads ../lib, so both are copied where nobody can read them.
      dir = Dir.mktmpdir("rbspy-cli-")
      @cleanup_dirs << dir
      FileUtils.cp_r(%w[lib exe].map { |d| File.join(RubySpyTest::ROOT, d) }, dir)
      FileUtils.chmod_R("a+rX", dir)
      exe = File.join(dir, "exe", "rubyspy")
      [%w[snapshot], %w[record --duration 0.2 --output /dev/null]].each do |command|
        argv = [RbConfig.ruby, exe, command.first, "--pid", target.pid.to_s, *command.drop(1)]
        out, err, status = Open3.capture3(*runner.call(argv), chdir: dir)
        report = "rubyspy #{command.first}\nexit: #{status.inspect}\nstdout: #{out}\nstderr: #{err}"
        expect(status.exitstatus).to eq(1), report
        expect(err.lines.size).to eq(1), report
        expect(err).to match(/permission denied reading process #{target.pid}/).and(include("CAP_SYS_PTRACE")), report
      end
      expect_unharmed(target)
    end
  end

  describe "a target that is gone" do
    it "raises ProcessExited or NoSuchProcess when the target was killed just before the call" do
      target = start_target("nested_methods")
      pid = target.pid
      target.kill!
      target.wait_until_zombie

      expect { RubySpy.snapshot(pid) }
        .to raise_error(an_error_naming(pid, RubySpy::ProcessExited, RubySpy::NoSuchProcess))
    end

    it "raises NoSuchProcess or ProcessExited once the killed target has been reaped" do
      target = start_target("nested_methods")
      pid = target.pid
      target.kill!
      target.reap
      skip "pid #{pid} was reused already" if File.exist?("/proc/#{pid}")

      expect { RubySpy.snapshot(pid) }
        .to raise_error(an_error_naming(pid, RubySpy::ProcessExited, RubySpy::NoSuchProcess))
    end

    it "raises ProcessExited or NoSuchProcess from a handle whose target died after attach" do
      target = start_target("nested_methods")
      pid = target.pid
      handle = RubySpy.attach(pid)
      expect(handle.snapshot).not_to be_empty
      target.kill!
      target.wait_until_zombie

      expect { handle.snapshot }
        .to raise_error(an_error_naming(pid, RubySpy::ProcessExited, RubySpy::NoSuchProcess))
      target.reap
      expect { handle.snapshot }
        .to raise_error(an_error_naming(pid, RubySpy::ProcessExited, RubySpy::NoSuchProcess))
    end
  end

  describe "a live Ruby target" do
    it "keeps working after being read many times" do
      target = start_target("responder", stdio: true)
      handle = RubySpy.attach(target.pid)

      20.times { expect(handle.snapshot.last.label).to eq("<main>") }
      expect_unharmed(target)
    end
  end
end
