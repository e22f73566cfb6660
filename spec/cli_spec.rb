# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "json"
require "tmpdir"

RSpec.describe "exe/rubyspy" do
  include RubySpyTest::Recording

  # A pid no process has: a child that has exited and been reaped.
  def gone_pid
    pid = Process.spawn("true")
    Process.wait(pid)
    pid
  end

  def monotonic
    Process.clock_gettime(Process::CLOCK_MONOTONIC)
  end

  # One line on stderr, no Ruby backtrace.
  def expect_one_line_error(err)
    expect(err.lines.size).to eq(1), "stderr:\n#{err}"
    expect(err).to start_with("rubyspy: ")
    expect(err).not_to match(/\.rb:\d+:in /)
  end

  around do |example|
    Dir.mktmpdir("rbspy-cli-") do |dir|
      @dir = dir
      example.run
    end
  end

  describe "snapshot" do
    it "--pid prints the frames RubySpy.snapshot returns, one per line" do
      target = start_target("nested_methods")
      run = rubyspy!("snapshot", "--pid", target.pid)
      expect(run.stderr).to eq("")
      expect(run.stdout.lines.map(&:chomp)).to eq(RubySpy.snapshot(target.pid).map(&:to_s))
      expect(run.stdout.lines.size).to eq(target.frames.size)
    end

    it "--threads all prints a Thread header per thread, each followed by its frames" do
      target = start_target("named_worker")
      run = rubyspy!("snapshot", "--pid", target.pid, "--threads", "all")
      headers = run.stdout.lines.map(&:chomp).grep(/\AThread /)
      expect(headers.size).to eq(2), run.stdout
      expect(headers).to all(match(/\AThread \d+( \([^)]*\))?( main)?: (running|waiting_for_gvl|blocked)\z/))
      expect(headers).to include("Thread #{target.pid} main: blocked")
      expect(headers).to include(a_string_matching(/\AThread \d+ \(worker\): running\z/))
      frames = run.stdout.lines.map(&:chomp).reject { |l| l.start_with?("Thread ") }
      expect(frames).to all(start_with("  "))
      expect(frames).to include(a_string_matching(method_label_pattern("Crunch", "digest", target.ruby_version)))
      expect(frames).to include(a_string_including("in 'Kernel#sleep'"))
    end

    it "--pid of a process that does not exist: exit 1, one line naming the pid" do
      pid = gone_pid
      run = rubyspy!("snapshot", "--pid", pid, exitstatus: 1)
      expect(run.stdout).to eq("")
      expect_one_line_error(run.stderr)
      expect(run.stderr).to include(pid.to_s)
    end

    it "without --pid is a usage error" do
      run = rubyspy!("snapshot", exitstatus: 2)
      expect_one_line_error(run.stderr)
    end
  end

  describe "record" do
    it "--pid with --duration, --format collapsed and --output writes parseable folded stacks" do
      target = start_target("named_worker")
      output = File.join(@dir, "out.txt")
      started = monotonic
      run = rubyspy!("record", "--pid", target.pid, "--rate", 200, "--duration", 1,
                     "--format", "collapsed", "--output", output)
      elapsed = monotonic - started

      expect(elapsed).to be_between(1.0, 5.0)
      expect(File.exist?(output)).to be(true)
      lines = parse_collapsed(File.read(output))
      written = run.stderr[/wrote (\d+) samples to #{Regexp.escape(output)}/, 1]
      expect(written).not_to be_nil, run.stderr
      # The sleeping main thread's samples are left out, and counted on stderr.
      idle = run.stderr[/(\d+) idle samples \(blocked threads\) left out of collapsed/, 1]
      expect(idle).not_to be_nil, run.stderr
      expect(lines.map(&:last).sum + Integer(idle)).to eq(Integer(written))
      expect(Integer(written)).to be > 100 # two threads, ~200 ticks
      expect(lines.map(&:first)).to include(a_string_matching(method_label_pattern("Crunch", "digest", target.ruby_version)))
      expect(target.health_problems).to eq([])
    end

    it "--threads gvl --on-cpu --format raw writes a raw profile of the GVL holder only" do
      target = start_target("named_worker")
      output = File.join(@dir, "out.raw")
      rubyspy!("record", "--pid", target.pid, "--rate", 300, "--duration", 0.5,
               "--threads", "gvl", "--on-cpu", "--format", "raw", "--output", output)
      profile = RubySpy::Profile.load(output)
      expect(profile.pid).to eq(target.pid)
      expect(profile.rate).to eq(300.0)
      expect(profile.threads.map { |t| t[:name] }).to eq(["worker"])
      expect(profile.threads.first[:states].keys).to eq(["running"])
    end

    it "-- COMMAND under sudo runs as SUDO_UID/SUDO_GID, and as root with --no-drop-root" do
      skip "needs root" unless Process.euid.zero?
      require "etc"
      nobody = Etc.getpwnam("nobody")
      shared = Dir.mktmpdir("rubyspy-sudo") # not under @dir, which nobody cannot enter
      File.chmod(0o1777, shared)
      script = 'File.write(ARGV[0], [Process.uid, Process.euid, Process.gid, Process.egid, ENV["HOME"]].join(":")); ' \
               "t = Process.clock_gettime(Process::CLOCK_MONOTONIC); " \
               "nil while Process.clock_gettime(Process::CLOCK_MONOTONIC) - t < 0.3"
      env = { "SUDO_UID" => nobody.uid.to_s, "SUDO_GID" => nobody.gid.to_s }
      cases = { [] => [nobody.uid, nobody.uid, nobody.gid, nobody.gid, nobody.dir],
                ["--no-drop-root"] => [0, 0, 0, 0, ENV.fetch("HOME")] }
      cases.each_with_index do |(flags, ids), i|
        ids_file = File.join(shared, "ids#{i}")
        rubyspy!("record", "-f", "raw", "-o", File.join(@dir, "p#{i}.raw"), *flags, "--", RbConfig.ruby, "-e", script,
                 ids_file, env: env)
        expect(File.read(ids_file)).to eq(ids.join(":")), flags.inspect
      end
    ensure
      FileUtils.rm_rf(shared) if shared
    end

    it "-- COMMAND under sudo that cannot be run says why in one line, and writes nothing" do
      skip "needs root" unless Process.euid.zero?
      require "etc"
      nobody = Etc.getpwnam("nobody")
      env = { "SUDO_UID" => nobody.uid.to_s, "SUDO_GID" => nobody.gid.to_s }
      output = File.join(@dir, "never.raw")
      missing = "/nonexistent/rubyspy-no-such-ruby" # not under @dir, which nobody cannot enter
      run = rubyspy!("record", "-f", "raw", "-o", output, "--", missing, env: env, exitstatus: 1)
      expect(run.stderr.lines).to eq(["rubyspy: cannot run #{missing} as uid #{nobody.uid}: No such file or directory - #{missing}\n"])
      expect(File.exist?(output)).to be(false)
    end

    it "-- COMMAND records the command until it exits and writes the profile" do
      output = File.join(@dir, "command.txt")
      script = <<~RUBY
        def rubyspy_cli_hot(seconds)
          deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + seconds
          x = 0
          x += 1 while Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
          x
        end
        rubyspy_cli_hot(1.0)
      RUBY
      run = rubyspy!("record", "--rate", 200, "--format", "collapsed", "--output", output,
                     "--", RbConfig.ruby, "-e", script)

      expect(File.exist?(output)).to be(true), run.stderr
      lines = parse_collapsed(File.read(output))
      expect(lines.map(&:first)).to include(a_string_including("rubyspy_cli_hot"))
      expect(lines.map(&:last).sum).to be > 100
      expect(run.stderr).to match(/exited/) # the note about the command's exit
    end

    # Attaching to a Ruby that is still initialising its VM fails with NotRubyProcess (the
    # error that says "try again"), never with a corrupt-memory error.
    it "attaching to a Ruby that is still starting fails only with NotRubyProcess (what -- COMMAND retries)" do
      other = Hash.new(0)
      10.times do
        pid = Process.spawn(RbConfig.ruby, "-e", "sleep 0.3", in: File::NULL)
        begin
          loop do
            RubySpy.attach(pid)
            break
          rescue RubySpy::NotRubyProcess
            next
          rescue RubySpy::Error => e
            other[e.class] += 1
            break
          end
        ensure
          Process.kill(:KILL, pid)
          Process.wait(pid)
        end
      end
      expect(other).to eq({})
    end

    it "--subprocesses records the target's Ruby children too" do
      target = start_target("preforking", "0.2")
      output = File.join(@dir, "tree.txt")
      rubyspy!("record", "--pid", target.pid, "--subprocesses", "--rate", 200,
               "--duration", 1.2, "--format", "collapsed", "--output", output)
      expect(File.read(output)).to include("first_child_work").and include("second_child_work")
    end

    it "an unknown --format: exit 2 with one line" do
      target = start_target("named_worker")
      run = rubyspy!("record", "--pid", target.pid, "--format", "nope", "--output", File.join(@dir, "x"), exitstatus: 2)
      expect_one_line_error(run.stderr)
      expect(run.stderr).to include("nope")
    end

    it "--pid of a process that does not exist: exit 1, one line naming the pid, no backtrace" do
      pid = gone_pid
      output = File.join(@dir, "x.txt")
      run = rubyspy!("record", "--pid", pid, "--duration", 0.2, "--output", output, exitstatus: 1)
      expect(run.stdout).to eq("")
      expect_one_line_error(run.stderr)
      expect(run.stderr).to include(pid.to_s)
      expect(File.exist?(output)).to be(false)
    end

    it "--verbose adds the backtrace to an error" do
      run = rubyspy!("record", "--verbose", "--pid", gone_pid, "--duration", 0.2,
                     "--output", File.join(@dir, "x.txt"), exitstatus: 1)
      expect(run.stderr.lines.size).to be > 1
      expect(run.stderr).to match(/\.rb:\d+:in /)
    end

    it "an unwritable --output: exit 2 before recording" do
      target = start_target("named_worker")
      started = monotonic
      run = rubyspy!("record", "--pid", target.pid, "--duration", 5, "--output", "/proc/nope/out.txt", exitstatus: 2)
      expect(monotonic - started).to be < 4 # did not record for 5 s first
      expect_one_line_error(run.stderr)
      expect(run.stderr).to include("/proc/nope/out.txt")
    end

    it "an unwritable --output with -- COMMAND: exit 2 without running the command" do
      marker = File.join(@dir, "command-ran")
      started = monotonic
      run = rubyspy!("record", "--output", "/proc/nope/out.txt", "--",
                     RbConfig.ruby, "-e", "File.write(ARGV[0], 'ran'); sleep 1", marker, exitstatus: 2)
      expect_one_line_error(run.stderr)
      expect(File.exist?(marker)).to be(false)
      expect(monotonic - started).to be < 1.5
    end

    it "neither --pid nor a command, or both: usage errors" do
      run = rubyspy!("record", "--output", File.join(@dir, "x"), exitstatus: 2)
      expect_one_line_error(run.stderr)

      run = rubyspy!("record", "--pid", 1, "--output", File.join(@dir, "x"), "--", "true", exitstatus: 2)
      expect_one_line_error(run.stderr)
    end
  end

  describe "report" do
    before(:context) do
      with_target("named_worker") do |target|
        @version = target.ruby_version
        @profile = RubySpy::Recorder.new(target.pid, rate: 300, duration: 0.3).start.wait.stop
      end
    end

    def raw_file
      path = File.join(@dir, "profile.raw")
      @profile.write(path, format: :raw)
    end

    it "--input RAW --format speedscope prints valid speedscope JSON" do
      run = rubyspy!("report", "--input", raw_file, "--format", "speedscope")
      doc = JSON.parse(run.stdout)
      expect(doc["$schema"]).to eq("https://www.speedscope.app/file-format-schema.json")
      expect(doc["profiles"].map { |p| p["name"] }).to eq(["All threads"])
      expect(run.stdout).to eq(@profile.render(:speedscope))
    end

    it "--output writes the file; the default format is summary" do
      output = File.join(@dir, "flame.svg")
      run = rubyspy!("report", "--input", raw_file, "--format", "flamegraph", "--output", output)
      expect(run.stdout).to eq("")
      expect(File.read(output)).to include("<svg")

      run = rubyspy!("report", "--input", raw_file)
      expect(run.stdout).to eq(@profile.to_s)
    end

    it "pprof to stdout is written byte for byte" do
      run = rubyspy!("report", "--input", raw_file, "--format", "pprof", binmode: true)
      expect(run.stdout.b).to eq(@profile.render(:pprof).b)
    end

    it "an unknown --format: exit 2 with one line" do
      run = rubyspy!("report", "--input", raw_file, "--format", "nope", exitstatus: 2)
      expect_one_line_error(run.stderr)
    end

    it "an input that is not a raw profile, or is missing: exit 1 with one line" do
      collapsed = File.join(@dir, "profile.txt")
      @profile.write(collapsed, format: :collapsed)
      [collapsed, File.join(@dir, "missing.raw")].each do |input|
        run = rubyspy!("report", "--input", input, "--format", "summary", exitstatus: 1)
        expect(run.stdout).to eq("")
        expect_one_line_error(run.stderr)
        expect(run.stderr).to include(input)
      end
    end

    it "an unwritable --output: exit 2" do
      run = rubyspy!("report", "--input", raw_file, "--output", "/proc/nope/x.txt", exitstatus: 2)
      expect_one_line_error(run.stderr)
    end
  end

  describe "flags shared with rbspy and py-spy" do
    it "--version and -V print the version and exit 0" do
      %w[--version -V].each do |flag|
        run = rubyspy(flag)
        expect([run.stdout, run.stderr, run.exitstatus]).to eq(["rubyspy #{RubySpy::VERSION}\n", "", 0])
      end
    end

    it "record takes -p, -r, -d, -f and -o" do
      target = start_target("nested_methods")
      path = File.join(@dir, "short.txt")
      rubyspy!("record", "-p", target.pid, "-r", 200, "-d", 1, "-f", "collapsed", "-o", path)
      counts = File.readlines(path).map { |line| Integer(line[/ (\d+)\n\z/, 1]) }
      expect(counts.sum).to be_between(100, 260) # 200 Hz for 1 s
      expect(File.read(path)).to include(target.frames.first.label)
    end

    it "snapshot --json prints the stack and tags; with --threads all every thread, as RubySpy.snapshot(pid, threads: :all)" do
      target = start_target("nested_methods")
      run = rubyspy!("snapshot", "-p", target.pid, "--json")
      doc = JSON.parse(run.stdout)
      expect(doc.values_at("pid", "ruby_version", "tags")).to eq([target.pid, target.ruby_version, {}])
      expect(doc["frames"]).to eq(RubySpy.snapshot(target.pid).map { |f| JSON.parse(JSON.generate(f.to_h)) })

      worker = start_target("named_worker")
      run = rubyspy!("snapshot", "-p", worker.pid, "--json", "--threads", "all")
      doc = JSON.parse(run.stdout)
      threads = doc.fetch("threads")
      # The threads a sample could not read are listed, not hidden: none of a parked worker's.
      expect(doc.fetch("dropped")).to eq([])
      api = RubySpy.snapshot(worker.pid, threads: :all)
      expect(threads.map { |t| t.values_at("tid", "name", "main") }).to eq(api.map { |t| t.values_at(:tid, :name, :main) })
      expect(threads.size).to be >= 2
      expect(threads.map { |t| t["frames"].size }).to all(be_positive)
      expect { RubySpy.snapshot(worker.pid, threads: :some) }.to raise_error(ArgumentError, /threads: must be :gvl .* or :all/)
    end

    it "--force-version reads the process with that release's layout, and names a release it lacks" do
      target = start_target("nested_methods")
      run = rubyspy!("snapshot", "-p", target.pid, "--force-version", target.ruby_version)
      expect(run.stdout.lines.map(&:chomp)).to eq(RubySpy.snapshot(target.pid).map(&:to_s))

      run = rubyspy!("snapshot", "-p", target.pid, "--force-version", "9.9.9", exitstatus: 1)
      expect_one_line_error(run.stderr)
      expect(run.stderr).to include("9.9.9")
    end
  end

  describe "--help" do
    it "prints the usage of each command and exits 0" do
      { "snapshot" => "Usage: rubyspy snapshot", "record" => "Usage: rubyspy record",
        "report" => "Usage: rubyspy report" }.each do |command, usage|
        %w[--help -h].each do |flag|
          run = rubyspy!(command, flag)
          expect(run.stderr).to eq("")
          expect(run.stdout).to start_with(usage)
        end
      end
      run = rubyspy("record", "--help")
      expect(run.stdout).to include("--rate", "--duration", "--format", "--output", "--threads", "--on-cpu", "--subprocesses")
      expect([run.stderr, run.exitstatus]).to eq(["", 0])
    end

    it "with no command or --help prints the command list" do
      [[], ["--help"], ["help"]].each do |args|
        run = rubyspy!(*args)
        expect(run.stdout).to include("snapshot", "record", "report")
      end
    end

    it "an unknown command: exit 2 with one line" do
      run = rubyspy!("frobnicate", exitstatus: 2)
      expect_one_line_error(run.stderr)
    end
  end
end

RSpec.describe "RubySpy::CLI in-process" do
  before do
    skip "the extension is built for the host Ruby" unless RubySpyTest::TargetRuby.current.host?
    require "rbspy_ext/cli"
  end

  # Runs the CLI in this process; [status, stdout, stderr].
  def run_cli(*args)
    out = StringIO.new
    err = StringIO.new
    saved = [$stdout, $stderr]
    $stdout = out
    $stderr = err
    status = RubySpy::CLI.run(args.map(&:to_s))
    [status, out.string, err.string]
  ensure
    $stdout, $stderr = saved
  end

  it "prints a target's stack as Ruby's own backtrace_locations would, and returns 0" do
    target = start_target("nested_methods")
    status, out, err = run_cli("snapshot", "--pid", target.pid)
    expect([status, err]).to eq([0, ""])
    frames = RubySpy.snapshot(target.pid)
    expect(out.lines.map(&:chomp)).to eq(frames.map(&:to_s))
    expect(frames).to match_backtrace(target.frames, ruby_version: target.ruby_version)
  end

  it "returns 2 with one line on stderr for a usage error" do
    status, out, err = run_cli("record", "--rate", "0", "--pid", Process.pid)
    expect(status).to eq(2)
    expect(out).to eq("")
    expect(err.lines.size).to eq(1)
    expect(err).to start_with("rubyspy: ")
  end
end
