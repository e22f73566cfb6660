# frozen_string_literal: true

require "json"
require "tmpdir"
require_relative "spec_helper"
require "rbspy_ext"

# How flamegraph, speedscope and collapsed show a recording (issue 16): by default every
# thread's functions merged and blocked threads left out; --per-thread, --lines, --idle and
# --state undo each, as flags of `rubyspy record`/`report` and keywords of Profile#render.
# One recording of named_worker (a worker spinning in Crunch#digest, the main thread asleep
# in Kernel#sleep) serves every example; each view is checked against the profile's own
# stacks and thread states.
RSpec.describe "profile views" do
  include RubySpyTest::Recording

  def report(*args)
    rubyspy!("report", "--input", @raw, *args)
  end

  def collapsed(*flags)
    parse_collapsed(report("--format", "collapsed", *flags).stdout)
  end

  before(:all) do
    @dir = Dir.mktmpdir("rubyspy-views")
    @target = RubySpyTest::Target.start("named_worker")
    @base = File.join(@dir, "worker")
    @raw = File.join(@dir, "worker.raw")
    @record_err = rubyspy!("record", "-p", @target.pid, "-r", 200, "-d", 1.5,
                           "-f", "collapsed", "-f", "flamegraph", "-f", "speedscope",
                           "-o", @base, "--raw", @raw).stderr

    @profile = RubySpy::Profile.load(@raw)
    @main_tid = @target.pid
    @worker_tid = @profile.threads.find { |t| t[:name] == "worker" }.fetch(:tid)
    @spin = (fixture_line("named_worker", "spin-start")..fixture_line("named_worker", "spin-end"))
  end

  after(:all) do
    @target&.stop
    FileUtils.rm_rf(@dir)
  end

  it "record writes several formats in one run, and the raw profile beside them" do
    expect(Dir.children(@dir).sort).to eq(%w[worker.collapsed.txt worker.raw worker.speedscope.json worker.svg])
    expect(@record_err).to include("wrote #{@profile.samples} samples to #{@base}.collapsed.txt, #{@base}.svg, " \
                                   "#{@base}.speedscope.json, #{@raw}")
    expect(File.read("#{@base}.collapsed.txt")).to eq(@profile.render(:collapsed))
    expect(@profile.samples_in(:running)).to be > 100
    expect(@profile.samples_in(:blocked)).to be > 100
  end

  it "by default merges threads into functions and leaves out the blocked main thread, saying so" do
    stacks = collapsed
    expect(stacks.sum(&:last)).to eq(@profile.samples - @profile.samples_in(:blocked))
    frames = stacks.flat_map { |stack, _| stack.split(";") }
    expect(frames).not_to include(a_string_starting_with("Thread "))
    expect(frames).not_to include(a_string_matching(/Kernel#sleep/))
    expect(frames).to include(a_string_matching(/\A#{method_label_pattern("Crunch", "digest", @target.ruby_version)} \S+named_worker\.rb\z/))
    expect(frames.grep(/named_worker\.rb/)).to all(match(/named_worker\.rb\z/)) # no :line
    err = report("--format", "collapsed").stderr
    expect(err).to eq("rubyspy: #{@profile.samples_in(:blocked)} idle samples (blocked threads) left out of collapsed; " \
                      "--idle shows them\n")
    svg = File.read("#{@base}.svg")
    expect(svg).to include("#{@profile.samples_in(:blocked)} idle samples (blocked threads) left out")
    name = JSON.parse(File.read("#{@base}.speedscope.json"))["name"]
    expect(name).to include("#{@profile.samples_in(:blocked)} idle samples (blocked threads) left out")
  end

  it "--per-thread gives each thread a root, --idle brings the blocked samples back" do
    worker_root = "Thread #{@worker_tid} (worker)"
    expect(collapsed("--per-thread").map { |stack, _| stack.split(";").first }.uniq).to eq([worker_root])
    all = collapsed("--per-thread", "--idle")
    expect(all.sum(&:last)).to eq(@profile.samples)
    main = all.select { |stack, _| stack.start_with?("Thread #{@main_tid} (main);") }
    expect(main.sum(&:last)).to eq(@profile.threads.find { |t| t[:main] }[:states].values.sum)
    expect(main.map(&:first)).to all(end_with(";Kernel#sleep"))
  end

  it "--lines splits functions by the line executing" do
    lines = collapsed("--lines").flat_map { |stack, _| stack.split(";") }
                                .filter_map { |f| f[/named_worker\.rb:(\d+)\z/, 1]&.to_i }
    expect(lines).not_to be_empty
    expect(lines.uniq.size).to be > 1 # the spin loop's lines, and the line calling digest
    expect(lines & @spin.to_a).not_to be_empty
  end

  it "--state roots each stack at its thread's state, with the profile's counts" do
    by_root = Hash.new(0)
    collapsed("--state", "--idle").each { |stack, n| by_root[stack.split(";").first] += n }
    expected = Hash.new(0)
    @profile.threads.each { |t| t[:states].each { |state, n| expected["[#{state}]"] += n } }
    expect(by_root).to eq(expected)
    expect(by_root.keys).to include("[running]", "[blocked]")
  end

  it "Profile#render takes the same options as keywords, and the flags' output is the keywords'" do
    out = report("--format", "collapsed", "--per-thread", "--lines", "--state").stdout
    expect(out).to eq(@profile.render(:collapsed, per_thread: true, lines: true, state: true))
    expect(@profile.render(:collapsed, idle: true)).to include("Kernel#sleep")
    expect { @profile.render(:callgrind, per_thread: true) }
      .to raise_error(ArgumentError, /--per-thread applies to flamegraph, speedscope and collapsed only, not to callgrind/)
    expect { @profile.render(:pprof, tag: :job) }.to raise_error(ArgumentError, /--by-tag/)
  end

  it "a view flag with formats that do not take it is a usage error naming those that do" do
    run = rubyspy!("report", "--input", @raw, "--format", "callgrind", "--per-thread", exitstatus: 2)
    expect(run.stderr).to eq("rubyspy: --per-thread applies to flamegraph, speedscope, collapsed only, not to callgrind\n")
    run = rubyspy!("record", "-p", @target.pid, "-d", 0.2, "-f", "pprof", "--idle", "-o", File.join(@dir, "x"), exitstatus: 2)
    expect(run.stderr).to include("--idle applies to flamegraph, speedscope, collapsed only, not to pprof")
    expect(File.exist?(File.join(@dir, "x"))).to be(false)
  end

  it "timeline: each thread's samples in time order, states and stacks as spans, rendered again from raw" do
    out = report("--format", "timeline").stdout
    expect(out).to eq(@profile.render(:timeline)) # raw keeps the order
    doc = JSON.parse(out)
    expect(doc["$schema"]).to eq("https://www.speedscope.app/file-format-schema.json")
    names = doc["profiles"].map { |p| p["name"] }
    expect(names).to contain_exactly("Thread #{@main_tid} (main)", "Thread #{@worker_tid} (worker)")
    worker = timeline_spans(doc, names.index("Thread #{@worker_tid} (worker)"))
    main = timeline_spans(doc, names.index("Thread #{@main_tid} (main)"))
    # The worker spins in Crunch#digest the whole time, the main thread sleeps.
    digest = worker.select { |path, _| path.first == "[running]" && path.last.match?(/digest/) }.values.sum
    expect(digest).to be > 0.9 * worker.values.sum
    expect(main.keys.map(&:first).uniq).to eq(["[blocked]"])
    expect(main.keys.map(&:last).uniq).to eq(["Kernel#sleep"])
    # Spans cover the recording: about 1.5 s each, as many samples as the profile counts.
    expect(worker.values.sum).to be_within(300).of(1500)
    expect(doc["profiles"].map { |p| p["type"] }).to all(eq("evented"))
  end

  it "speedscope: one profile of every thread by default, one per thread with --per-thread" do
    merged = JSON.parse(@profile.render(:speedscope))
    expect(merged["profiles"].map { |p| p["name"] }).to eq(["All threads"])
    expect(merged["shared"]["frames"]).to all(satisfy { |f| !f.key?("line") })
    threads = JSON.parse(@profile.render(:speedscope, per_thread: true, idle: true))
    expect(threads["profiles"].map { |p| p["name"] })
      .to contain_exactly("Thread #{@main_tid} (main)", "Thread #{@worker_tid} (worker)")
  end
end
