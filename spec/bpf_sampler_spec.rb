# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "etc"
require "open3"
require "tmpdir"
require "fileutils"

# The in-kernel sampler (mode: :bpf, rubyspy record --bpf) against real Ruby processes: the
# snapshot corpus's fixtures spinning where they would park (PARK_SPIN=1, spec/fixtures/lib/
# park.rb), so the kernel samples them on a CPU, compared with Ruby's own caller_locations
# and with the user-space sampler; tags; the depth cap; and the ways it fails. Needs root
# (CAP_BPF and CAP_PERFMON); the matrix in script/test runs it against every chroot Ruby.
#
# The kernel samples a thread only while it is on a CPU: on a machine busy with other work a
# spinning target gets fewer samples a second. Examples that need a number of samples record
# until they have it (record_until_samples), and rates are checked against the CPU time the
# target had, never against the wall clock.
RSpec.describe "the BPF sampler" do
  include RubySpyTest::Recording

  # The snapshot corpus (spec/snapshot_spec.rb), each spinning where it parks.
  corpus = %w[nested_methods nested_blocks qualified_names class_body define_method eval_strings
              required_method park_in_require park_in_rescue park_in_ensure fiber deep_recursion
              long_method top_level_blocks yield_and_procs super_chain method_missing
              anonymous_classes iterators c_calls_c]

  before do
    skip "loading BPF programs needs root (CAP_BPF and CAP_PERFMON)" unless Process.uid.zero?
  end

  def spinning(name, *args, env: {})
    start_target(name, *args, env: { "PARK_SPIN" => "1" }.merge(env))
  end

  def record(pid, mode:, rate: 999, duration: 0.6)
    RubySpy::Recorder.new(pid, rate: rate, duration: duration, mode: mode).start.wait.stop
  end

  # [samples whose frames are exactly +expected+, all samples] of a profile's stacks.
  def exact_share(profile, expected, version)
    stacks = profile.stacks
    exact = stacks.select { |s| RubySpyTest::FrameComparison.problems(s[:frames], expected, version).empty? }
    [exact.sum { |s| s[:samples] }, stacks.sum { |s| s[:samples] }]
  end

  def describe_stacks(profile, expected, version)
    profile.stacks.max_by(3) { |s| s[:samples] }.map do |s|
      "#{s[:samples]} samples:\n#{RubySpyTest::FrameComparison.side_by_side(s[:frames], expected, version)}"
    end.join("\n")
  end

  # The BPF programs and maps process +pid+ holds, by id, from its descriptors' fdinfo: its
  # own, whatever other recordings share the machine.
  def bpf_objects(pid)
    ids = { "prog" => [], "map" => [] }
    Dir.glob("/proc/#{pid}/fdinfo/*").each do |info|
      File.read(info).scan(/^(prog|map)_id:\s+(\d+)/) { |kind, id| ids[kind] << id.to_i }
    rescue Errno::ENOENT, Errno::ESRCH
      next # a descriptor closed meanwhile
    end
    ids.transform_values(&:uniq)
  end

  def loaded?(kind, id)
    shown = system("bpftool", kind, "show", "id", id.to_s, out: File::NULL, err: File::NULL)
    raise "bpftool is missing (script/setup installs it)" if shown.nil?

    shown
  end

  # Waits until process +pid+ holds a BPF program and its maps besides those of +already+
  # (what it held before), and returns their ids.
  def held_bpf_objects(pid, already: { "prog" => [], "map" => [] }, timeout: 30)
    wait_for("the recorder's program loaded", timeout: timeout) do
      # Once its sampler thread runs, the recorder has loaded and attached its program: before,
      # the ids could be libbpf's probes of what the kernel supports, loaded and closed at once.
      next unless sampler_thread?(pid)

      ids = bpf_objects(pid).to_h { |kind, list| [kind, list - already.fetch(kind)] }
      ids if ids["prog"].any? && ids["map"].any?
    end
  end

  # The kernel frees a program and its maps once their last descriptor closes (after an RCU
  # grace period): the objects of +held+ still loaded after waiting up to 10 s for them to go.
  def still_loaded(held)
    left = -> { held.flat_map { |kind, ids| ids.select { |id| loaded?(kind, id) }.map { |id| "#{kind} #{id}" } } }
    begin
      wait_for("the programs and maps unloaded", timeout: 10, interval: 0.1) { left.call.empty? }
    rescue RuntimeError
      # The expectation names what is left.
    end
    left.call
  end

  describe "on the snapshot corpus" do
    corpus.each do |name|
      it "gives Ruby's own stack, lines included, for >= 99 % of samples, as the user-space sampler does (#{name})" do
        target = spinning(name)
        version = target.ruby_version
        # About 0.3 s at 999 Hz of a thread that never leaves the CPU, on an idle machine. A
        # parked thread's stack never changes, so a wrong frame shows in every sample: 300
        # tell as well as more did, and 260 of these examples run in each CI.
        bpf = record_until_samples(target.pid, samples: 300, mode: :bpf, rate: 999)
        exact, total = exact_share(bpf, target.frames, version)
        expect(total).to eq(bpf.samples)
        expect(exact).to be >= 0.99 * total, describe_stacks(bpf, target.frames, version)
        expect(bpf.errors.values.sum).to be <= 0.01 * total, bpf.errors.inspect

        user = record(target.pid, mode: :user, rate: 499, duration: 0.2)
        top = ->(p) { p.stacks.max_by { |s| s[:samples] }[:frames].map(&:to_s) }
        expect(top.(bpf)).to eq(top.(user))
        expect(target.health_problems).to eq([])
      end
    end
  end

  it "samples a CPU-bound thread at the requested rate of its CPU time, as running, and reports what it cost" do
    target = spinning("nested_methods")
    cpu_before = thread_cpu_seconds(target.pid)
    started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    profile = record_until_samples(target.pid, samples: 900, mode: :bpf, rate: 999)
    wall = Process.clock_gettime(Process::CLOCK_MONOTONIC) - started
    cpu = thread_cpu_seconds(target.pid) - cpu_before
    # One thread on one CPU at a time: each tick of the CPU it runs on is a sample, so 999 a
    # second of the CPU time it gets (all of it on an idle machine, a share on a busy one).
    # Its CPU time within the recording is all it had, less at most the wall time the
    # attaching and stopping around the recording took.
    inside = cpu - (wall - profile.duration)
    expect(profile.samples).to be_between(0.9 * 999 * inside, 1.1 * 999 * cpu + 10),
                               format("%d samples for %.3f s of CPU (at least %.3f s of it in the %.3f s recording)",
                                      profile.samples, cpu, inside, profile.duration)
    expect(profile.threads.sum { |t| t[:states]["running"].to_i }).to eq(profile.samples)
    cost = profile.cost
    expect(cost[:bpf_runs]).to be >= profile.samples
    expect(cost[:bpf_per_run_us]).to be_between(0.01, 100)
    expect(cost[:bpf_per_tick_us]).to be > 0
    # One wake-up per 50 ms drain (each sleeps the 50 ms at least), not one per sample.
    expect(cost[:wakeups]).to be_between(2, profile.duration / 0.05 + 1)
    expect(cost[:wakeups]).to be < profile.samples / 10
    expect(profile.notes.join).to include("sampled in the kernel")
    expect(profile.render(:summary)).to include("Profiler cost (BPF)")
  end

  it "tags each sample with the tags of the fiber running, as the user-space sampler does" do
    skip "the extension is not built for #{RubySpyTest::TargetRuby.current}" unless RubySpyTest::TargetRuby.current.extension?

    target = spinning("tagged")
    bpf = record(target.pid, mode: :bpf)
    user = record(target.pid, mode: :user, rate: 499, duration: 0.3)
    expected = target.info["tags"].transform_keys(&:to_sym)
    running = ->(p) { p.tags.reject { |t| t[:tags].empty? }.map { |t| t[:tags] } }
    expect(running.(bpf)).to eq([expected]), bpf.tags.inspect
    expect(running.(user)).to include(expected)
    # Every BPF sample is of the tagged main thread (the worker sleeps): all carry the tags.
    expect(bpf.tags.find { |t| t[:tags] == expected }[:samples]).to eq(bpf.samples)
  end

  it "never gives a sample tags it did not run under, while tables of Strings are replaced every few microseconds" do
    skip "the extension is not built for #{RubySpyTest::TargetRuby.current}" unless RubySpyTest::TargetRuby.current.extension?

    target = start_target("tag_churn")
    valid = target.info.fetch("sets").map { |set| set.to_h { |k, v| [k.to_sym, v.to_s] } } + [{}]
    profile = record(target.pid, mode: :bpf, rate: 999, duration: 1.5)
    seen = profile.tags.map { |t| t[:tags] }
    expect(seen - valid).to eq([]), "tag sets never set: #{(seen - valid).inspect}"
    expect(seen & valid[0..2]).not_to be_empty
    # The fixture spends most of its time between tag blocks; the user-space sampler says how
    # much is inside. Draining within the window a replaced table's Strings live keeps the
    # tags of all but a few samples (the first drain, 50 ms after the start, loses some, and
    # the notes count them).
    share = ->(p) { p.tags.reject { |t| t[:tags].empty? }.sum { |t| t[:samples] }.fdiv(p.samples) }
    user = record(target.pid, mode: :user, rate: 999, duration: 1.5)
    expect(share.(profile)).to be >= 0.5 * share.(user), "#{profile.tags.inspect}\nuser-space: #{user.tags.inspect}"
    lost = profile.notes.join[/(\d+) samples were recorded without their tags/, 1].to_i
    expect(lost).to be <= 0.05 * profile.samples, profile.notes.inspect
    # Drained every few ms while tags were being lost, not every 50 ms.
    expect(profile.cost[:wakeups]).to be > 2 * profile.duration / 0.05
  end

  it "keeps the innermost 512 frames of a deeper stack and marks the cut" do
    target = spinning("deep_spin", "600")
    profile = record_until_samples(target.pid, samples: 200, mode: :bpf, rate: 999)
    stacks = profile.stacks
    expect(stacks).not_to be_empty
    stacks.each do |s|
      expect(s[:frames].size).to eq(513)
      expect(s[:frames].last.label).to eq("[truncated]")
    end
    top = stacks.max_by { |s| s[:samples] }
    problems = RubySpyTest::FrameComparison.problems(top[:frames].first(512), target.frames.first(512),
                                                     target.ruby_version)
    expect(problems).to eq([])
    expect(profile.notes.join).to include("deeper than 512 frames")
  end

  it "cuts a stack whose value stack is longer than it copies at the first frame it misses, and marks the cut" do
    target = spinning("deep_spin", "400", "wide")
    # Each copy here is the whole 128 KiB of value stack: the 8 MiB ring holds 64, and at
    # 999 Hz a 50 ms drain takes 50, so a recorder a little late (a busy machine) would
    # fill it. This example is about the cut, not the ring: 249 Hz leaves room for four.
    profile = record_until_samples(target.pid, samples: 150, mode: :bpf, rate: 249)
    total = profile.stacks.sum { |s| s[:samples] }
    expect(total).to eq(profile.samples)
    expect(profile.errors.values.sum).to be <= 0.01 * total, profile.errors.inspect
    top = profile.stacks.max_by { |s| s[:samples] }
    kept = top[:frames][0..-2]
    expect(top[:frames].last.label).to eq("[truncated]")
    # 400 levels of 40 locals do not fit in 128 KiB of value stack; the innermost levels do.
    expect(kept.size).to be_between(100, 399)
    problems = RubySpyTest::FrameComparison.problems(kept, target.frames.first(kept.size), target.ruby_version)
    expect(problems).to eq([])
    expect(profile.notes.join).to include("value stack longer than the BPF sampler copies")
  end

  it "records a target that exits, keeps its samples, and leaves no program behind" do
    # 0.5 s of CPU time, however long the machine takes to give it: ~500 samples at 999 Hz.
    target = start_target("exits_soon", "0.5", "cpu")
    profile = nil
    # This process loads the program: its own new ids, whatever other recordings share the
    # machine (or an earlier example left).
    already = bpf_objects(Process.pid)
    held = Thread.new { held_bpf_objects(Process.pid, already: already, timeout: 60) }
    begin
      Timeout.timeout(60) { profile = record(target.pid, mode: :bpf, duration: 30) }
    ensure
      held.join(1) || held.kill # seen loaded during the recording, or never
    end
    expect(profile.duration).to be < 15 # ended by the exit, not by its 30 s
    expect(profile.samples).to be >= 0.5 * 999 * 0.5, "#{profile.samples} samples; errors #{profile.errors}"
    expect(profile.notes.join).to include("exited")
    expect(held.value).not_to be_nil, "the recording's program was never seen loaded"
    expect(still_loaded(held.value)).to eq([])
  end

  it "writes a pprof profile that go tool pprof reads, from rubyspy record --bpf, and unloads on Ctrl-C" do
    target = spinning("nested_methods")
    Dir.mktmpdir("rubyspy-bpf") do |dir|
      out = File.join(dir, "p.pb.gz")
      cmd = rubyspy_command("record", "--pid", target.pid, "--bpf", "--rate", 999, "--format", "pprof", "-o", out)
      popen_killed_after(*cmd, chdir: RubySpyTest::ROOT) do |_in, _out, err, wait|
        held = held_bpf_objects(wait.pid)
        expect(held["prog"].size).to eq(1)
        sleep 0.5
        Process.kill(:INT, wait.pid)
        expect(exit_status(wait, "rubyspy record --bpf after SIGINT").exitstatus).to eq(0), err.read
        expect(still_loaded(held)).to eq([])
      end
      expect(pprof_functions(out)).to include("Object#level6", "Park.spin")
    end
  end

  it "leaves no program or map behind when the recording process is killed outright" do
    target = spinning("nested_methods")
    pid = Process.spawn(*rubyspy_command("record", "--pid", target.pid, "--bpf", "-f", "collapsed", "-o", File::NULL),
                        chdir: RubySpyTest::ROOT, out: File::NULL, err: File::NULL)
    held = held_bpf_objects(pid)
    expect(held.flat_map { |kind, ids| ids.map { |id| loaded?(kind, id) } }).to all(be(true))
    Process.kill(:KILL, pid)
    Process.wait(pid)
    # Closed with the process's files.
    expect(still_loaded(held)).to eq([])
    expect(target.health_problems).to eq([])
  end

  it "finds the target when the profiler runs in a PID namespace of its own, as in a container" do
    Dir.mktmpdir("rubyspy-pidns") do |dir|
      out = File.join(dir, "out.txt")
      # 1.5 s of CPU time, however long the machine takes to give it: what the kernel samples.
      script = <<~RUBY
        def spin_in_namespace(seconds)
          deadline = Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID) + seconds
          x = 0
          x += 1 while Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID) < deadline
          x
        end
        spin_in_namespace(1.5)
      RUBY
      # Inside, the command's pid is 2; the kernel knows it by another.
      run = rubyspy!("record", "--bpf", "--rate", 499, "--format", "collapsed", "--output", out,
                     "--", RbConfig.ruby, "-e", script, under: %w[unshare --pid --fork --mount-proc])
      lines = File.readlines(out)
      expect(lines.sum { |l| l.split.last.to_i }).to be > 0.8 * 1.5 * 499 * 0.8, run.stderr
      expect(lines.join).to include("spin_in_namespace")
    end
  end

  describe "failing with a reason" do
    it "says what privilege is missing when run as nobody, before attaching" do
      target = spinning("nested_methods")
      nobody = Etc.getpwnam("nobody")
      dir = Dir.mktmpdir("rubyspy-nobody").tap { |d| File.chmod(0o777, d) }
      out = File.join(dir, "p.svg")
      setpriv = ["setpriv", "--reuid=#{nobody.uid}", "--regid=#{nobody.gid}", "--clear-groups"]
      run = rubyspy("record", "--pid", target.pid, "--bpf", "-d", 1, "-o", out, under: setpriv)
      written = File.exist?(out)
      FileUtils.rm_rf(dir)
      expect(written).to be(false)
      expect(run.exitstatus).to eq(1), run.to_s
      expect(run.stderr).to include("BPF sampler cannot run").and include("CAP_BPF").and include("uid #{nobody.uid}")
      expect(run.stderr.lines.size).to eq(1), run.stderr
    end

    it "raises RubySpy::BpfUnavailable from Ruby for the same reason" do
      nobody = Etc.getpwnam("nobody")
      script = <<~RUBY
        require "rbspy_ext"
        begin
          RubySpy::Recorder.new(#{Process.pid}, mode: :bpf, duration: 1).start
        rescue RubySpy::BpfUnavailable => e
          puts "BpfUnavailable: \#{e.message}"
        end
      RUBY
      out, status = Open3.capture2e("setpriv", "--reuid=#{nobody.uid}", "--regid=#{nobody.gid}", "--clear-groups",
                                    RbConfig.ruby, "-I", File.join(RubySpyTest::ROOT, "lib"), "-e", script)
      expect(status.exitstatus).to eq(0), out
      expect(out).to start_with("BpfUnavailable: the BPF sampler cannot run: loading a BPF program needs root")
    end

    it "rejects a mode it does not know, and subprocesses with the BPF sampler" do
      expect { RubySpy::Recorder.new(Process.pid, mode: :ebpf) }.to raise_error(ArgumentError, /mode must be :user or :bpf/)
      recorder = RubySpy::Recorder.new(Process.pid, mode: :bpf, subprocesses: true)
      expect { recorder.start }.to raise_error(ArgumentError, /records one process/)
    end
  end

  # Under M:N the program cannot know a Ruby thread by its native thread; it reads which one
  # runs there from Ruby's own ruby_current_ec thread-local, whose offset from the thread
  # pointer user space finds by the main thread's context (Capture::ec_tls).
  it "records an M:N target in the kernel, through Ruby's own ruby_current_ec, and says so" do
    skip "M:N threads need Ruby 3.3+" unless version_at_least?(RubySpyTest::TargetRuby.current.version.to_s, 3, 3)

    target = start_target("busy_main", env: { "RUBY_MN_THREADS" => "1" })
    profile = record(target.pid, mode: :bpf, rate: 199, duration: 0.5)
    expect(profile.notes.join).to include("M:N threads").and include("ruby_current_ec")
    expect(profile.cost).to include(:bpf_runs)
    main = profile.threads.find { |t| t[:main] }
    expect(main[:states].values.sum).to be > 0
    in_churn = profile.stacks.select { |s| s[:thread] == profile.threads.index(main) }
                      .select { |s| s[:frames].any? { |f| f.label.end_with?("churn") } }
    expect(in_churn.sum { |s| s[:samples] }).to be >= 0.9 * main[:states].values.sum
  end
end
