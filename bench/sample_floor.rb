# frozen_string_literal: true

# The user-space sampler against the floor of its reads, and against rbspy, in one run
# (issue 67), at 1 kHz on a ~20-frame and a ~200-frame CPU-bound target:
#
#   rake compile && ruby bench/sample_floor.rb [SECONDS] [ROUNDS]    # 3 s, 3 rounds
#   PERF=1 ruby bench/sample_floor.rb   # and where the time goes (perf's software clock)
#
# Each round runs, in turn against the same target process:
# - ours: core/examples/record.rs, the recorder alone (no Ruby in the sampling process): the
#   sampler thread's CPU per tick;
# - floor: core/examples/floor.rs, a loop that wakes at the same rate with the same timer and
#   makes the same process_vm_readv calls of the same bytes as the recorder's samples (noted
#   over a second of sampling), and nothing else: its CPU per wake-up;
# - rbspy: `rbspy record --nonblocking --rate 1000`, CPU per sample from the kernel's
#   accounting of the rbspy process.
# Prints the medians, ours / floor (the target: at most 1.3), rbspy / ours (at least 3), and
# how the cost above the floor grows from 20 to 200 frames against the bytes read.
$LOAD_PATH.unshift File.expand_path("../lib", __dir__)
require "rbspy_ext"
require "tmpdir"
require_relative "support"

SECONDS_EACH = Float(ARGV[0] || 3)
ROUNDS_EACH = Integer(ARGV[1] || 3)
ROOT = File.expand_path("..", __dir__)
RATE = 1000

def example(name, *args)
  IO.popen(["cargo", "run", "--quiet", "--release", "-p", "rbspy_ext_core", "--example", name, "--", *args.map(&:to_s)],
           chdir: ROOT, &:read)
end

def median(values) = values.sort[values.size / 2]

def rbspy_per_sample(rbspy, pid)
  Dir.mktmpdir do |dir|
    file = File.join(dir, "out.txt")
    before = children_cpu
    system(rbspy, "record", "--pid", pid.to_s, "--nonblocking", "--rate", RATE.to_s,
           "--duration", SECONDS_EACH.ceil.to_s, "--format", "collapsed", "--file", file,
           "--silent", out: File::NULL, err: File::NULL)
    cpu = children_cpu - before
    samples = File.exist?(file) ? File.readlines(file).sum { |l| l.split.last.to_i } : 0
    samples.zero? ? Float::NAN : cpu * 1e6 / samples
  end
end

# Build both examples before anything is timed.
system("cargo", "build", "--quiet", "--release", "-p", "rbspy_ext_core", "--example", "record",
       "--example", "floor", chdir: ROOT) or abort "cargo build of the examples failed"
rbspy = rbspy_binary

rows = {}
{ "~20 frames" => 8, "~200 frames" => 66 }.each do |label, depth|
  seconds = ROUNDS_EACH * (3 * SECONDS_EACH + 4) + 5
  run_target(seconds, depth: depth) do |pid|
    frames = RubySpy.snapshot(pid).size
    ours, floor, theirs, bytes, calls = [], [], [], nil, nil
    ROUNDS_EACH.times do
      line = example("record", pid, RATE, SECONDS_EACH)
      ours << line[/([\d.]+) us CPU per tick/, 1].to_f
      line = example("floor", pid, RATE, SECONDS_EACH)
      floor << line[/([\d.]+) us CPU per wake-up/, 1].to_f
      calls = line[/([\d.]+) calls/, 1].to_f
      bytes = line[/([\d.]+) bytes per sample/, 1].to_f
      theirs << rbspy_per_sample(rbspy, pid)
    end
    rows[label] = { frames: frames, ours: median(ours), floor: median(floor), rbspy: median(theirs),
                    bytes: bytes, calls: calls }
    r = rows[label]
    puts format("%-11s (%d frames): ours %.1f us a sample (%s), floor %.1f us (%s; %.2f calls, %.0f bytes), " \
                "rbspy %.1f us (%s)", label, frames, r[:ours], ours.map { |x| x.round(1) }.join(" "),
                r[:floor], floor.map { |x| x.round(1) }.join(" "), calls, bytes, r[:rbspy],
                theirs.map { |x| x.round(1) }.join(" "))
    puts format("%-11s ours / floor %.2fx, rbspy / ours %.1fx", label, r[:ours] / r[:floor], r[:rbspy] / r[:ours])
  end
end
# Where the recorder's time goes: perf's software clock over the record example (hardware
# counters do not work in this VM), the symbols with the most samples, self and with callees.
if ENV["PERF"] == "1" && system("perf", "--version", out: File::NULL, err: File::NULL)
  bin = File.join(ENV.fetch("CARGO_TARGET_DIR", File.join(ROOT, "target")), "release", "examples", "record")
  run_target(SECONDS_EACH + 4, depth: 8) do |pid|
    Dir.mktmpdir do |dir|
      data = File.join(dir, "perf.data")
      system("perf", "record", "-q", "-e", "cpu-clock", "-F", "20000", "-g", "-o", data, "--", bin, pid.to_s,
             RATE.to_s, SECONDS_EACH.to_s, out: File::NULL, err: File::NULL)
      report = IO.popen(["perf", "report", "-i", data, "--no-children", "--stdio", "--percent-limit", "2",
                         "-g", "none", "--sort", "symbol"], err: File::NULL, &:read)
      puts "where a ~20-frame sample's time goes (perf cpu-clock, self):"
      puts report.lines.grep(/%/).first(25)
    end
  end
end

small, deep = rows.values_at("~20 frames", "~200 frames")
above = ->(r) { r[:ours] - r[:floor] }
puts format("from %d to %d frames: bytes read %.1fx, cost above the floor %.1f -> %.1f us (%.1fx)",
            small[:frames], deep[:frames], deep[:bytes] / small[:bytes], above[small], above[deep],
            above[deep] / above[small])
