# frozen_string_literal: true

require_relative "spec_helper"
require "json"
require "open3"
require "rbspy_ext"

# A CPU-bound recording of a target whose hot method a JIT has compiled (run with
# RUBYSPY_TARGET_RUBY=NAME:outside:yjit or :zjit; without a JIT it is the control).
#
# A JIT keeps every caller's frame exact (it writes cfp->pc before a call), so labels and
# callers' lines must be exact. The innermost frame's pc is only written at calls and side
# exits, so in a hot loop its line may lag (stuck where the pc was last written): it must
# still be one of the method's own lines, and the spec prints how the samples spread over
# them so a human can see how often the innermost line is exact.
RSpec.describe "recording a JIT-compiled CPU-bound target" do
  let(:ruby) { RubySpyTest::TargetRuby.current }

  # The fixture (spec/fixtures/jit_spin.rb).
  def fixture
    "jit_spin"
  end

  # Every line of Inner#work, def to end: Ruby itself shows the end line while the method
  # returns.
  def work_range
    fixture_line(fixture, "WORK_DEF")..fixture_line(fixture, "WORK_END")
  end

  def work_frame?(frame)
    frame.base_label == "work" && frame.path.to_s.end_with?("fixtures/#{fixture}.rb")
  end

  # Starts the fixture (skipping when a JIT was asked for but is not on), records its main
  # thread, and returns [target, jit, samples in Inner#work as [frames, count], other
  # main-thread samples as [frames, count, state]].
  def record_work
    target = start_target(fixture)
    jit = target.info["jit"]
    if ruby.jit && jit.nil?
      skip "#{ruby} was asked for --#{ruby.jit} but the JIT is not on in the target " \
           "(#{target.info["ruby_description"]})"
    end
    expect(target.frames.first.base_label).to eq("work")

    profile = RubySpy::Recorder.new(target.pid, rate: 500, duration: 1.5, threads: :all).start.wait.stop
    # The recording names the JIT the fixture says is on (the firefox format's metadata).
    expect(profile.jit).to eq(jit&.upcase)
    main = profile.threads.index { |t| t[:main] }
    expect(main).not_to be_nil, "no main thread in #{profile.threads.inspect} " \
                               "(#{profile.samples} samples, errors #{profile.errors.inspect}, notes #{profile.notes.inspect})"
    mine = profile.stacks.select { |s| s[:thread] == main }
    in_work, other = mine.partition { |s| s[:frames].any? { |f| work_frame?(f) } }
    expect(in_work.sum { |s| s[:samples] }).to be >= 200,
                                                "#{in_work.sum { |s| s[:samples] }} samples in work; " \
                                                "errors #{profile.errors.inspect}; others:\n#{describe_stacks(other)}"
    expect(target.health_problems).to eq([])
    [target, jit, in_work.map { |s| [s[:frames], s[:samples]] },
     other.map { |s| [s[:frames], s[:samples], s[:state]] }]
  end

  # The five commonest of Profile#stacks, one per line.
  def describe_stacks(stacks)
    stacks.max_by(5) { |s| s[:samples] }.map do |s|
      "  #{s[:samples]}x [#{s[:state]}] #{s[:frames].map(&:to_s).join(" <- ")}"
    end.join("\n")
  end

  # A stack in Inner#work split into the C frames above it and the Ruby frames from it
  # outward. Without a JIT the arithmetic never pushes a frame; YJIT on 3.2 calls Integer#*
  # and Integer#/ as C methods (a real frame: Ruby's own backtrace would show it too).
  def split_c_frames(frames)
    c = frames.take_while(&:c_function?)
    [c, frames.drop(c.size)]
  end

  # {line => samples} of the innermost Ruby frame, over the samples in work.
  def innermost_lines(in_work)
    in_work.each_with_object(Hash.new(0)) do |(frames, count), h|
      h[split_c_frames(frames).last.first.lineno] += count
    end
  end

  def report(target, jit, in_work, other)
    lines = innermost_lines(in_work)
    total = lines.values.sum
    top_line, top = lines.max_by { |_, n| n }
    markers = %w[WORK_DEF WORK_FIRST WORK_LOOP WORK_LAST WORK_END].to_h { |m| [fixture_line(fixture, m), m] }
    puts "\n#{ruby.host? ? "host" : ruby} Ruby #{target.ruby_version}, JIT: #{jit || "none"} " \
         "(#{target.info["warmup_calls"]} warm-up calls)"
    puts format("  innermost line of Inner#work over %d samples (%d distinct lines, %.1f%% at line %d)",
                total, lines.size, 100.0 * top / total, top_line)
    lines.sort.each do |line, n|
      puts format("    line %3d %6d  %5.1f%%%s", line, n, 100.0 * n / total, markers[line] ? "  (#{markers[line]})" : "")
    end
    c_calls = in_work.each_with_object(Hash.new(0)) do |(frames, count), h|
      c, = split_c_frames(frames)
      h[c.map(&:label).join(" <- ")] += count unless c.empty?
    end
    c_calls.each { |labels, n| puts "  #{n} samples in C method #{labels} called by Inner#work" }
    other_count = other.sum { |_, n, _| n }
    puts "  #{other_count} main-thread samples outside Inner#work" unless other_count.zero?
    lines
  end

  it "labels every frame and gives every caller's exact line; the innermost line is within the method" do
    target, jit, in_work, other = record_work
    version = target.ruby_version
    expected = target.frames
    expect([expected[1].lineno, expected.last.lineno])
      .to eq([fixture_line(fixture, "CALL_WORK"), fixture_line(fixture, "CALL_RUN")]), expected.map(&:to_s).inspect
    bad = []
    # Samples whose only fault is a caller's line: the sampler reads the frames one by one
    # while the target runs, so a read that straddles Inner#work returning sees the block
    # already at its next line. Tolerated in a few samples, listed when there are too many.
    torn = []
    in_work.each do |all_frames, count|
      c_frames, frames = split_c_frames(all_frames)
      problems = []
      problems << "innermost Ruby frame is not Inner#work" unless work_frame?(frames.first)
      c_frames.each do |c|
        # A C frame shows its caller's path and line: Inner#work's, at the call, so exact.
        next if [c.path, c.lineno] == [frames.first.path, frames.first.lineno]

        problems << "C frame #{c.label} at #{c.path}:#{c.lineno}, not at its caller's #{frames.first.path}:" \
                    "#{frames.first.lineno}"
      end
      problems << "#{frames.size} Ruby frames, expected #{expected.size}" unless frames.size == expected.size
      [frames.size, expected.size].min.times do |i|
        a = frames[i]
        e = expected[i]
        unless RubySpyTest::FrameComparison.label_matches?(a.label, e.label, version)
          problems << "frame #{i}: label #{a.label.inspect}, expected #{e.label.inspect}"
        end
        problems << "frame #{i}: path #{a.path.inspect}, expected #{e.path.inspect}" unless a.path == e.path
        next if i.zero? # the innermost line may lag under a JIT: checked against the range below

        problems << "frame #{i}: line #{a.lineno}, expected #{e.lineno}" unless a.lineno == e.lineno
      end
      # Line 0 is Ruby's own answer at the nop Ruby 3.0 gives line 0 (see the fixture).
      unless work_range.cover?(frames.first.lineno) || (frames.first.lineno.zero? && target.info["line_zero"])
        problems << "innermost line #{frames.first.lineno} outside Inner#work's #{work_range}"
      end
      next if problems.empty?

      entry = "  #{count}x #{all_frames.map(&:to_s).join(" <- ")}\n    #{problems.join("\n    ")}"
      if problems.all? { |p| p.match?(/\Aframe [1-9]\d*: line /) }
        torn << [count, entry]
      else
        bad << entry
      end
    end
    report(target, jit, in_work, other)

    total = in_work.sum { |_, n| n }
    torn_samples = torn.sum(&:first)
    puts "  #{torn_samples} samples with a caller's line torn (read while Inner#work returned)" unless torn.empty?
    expect(torn_samples).to be <= [2, total / 100].max,
                            "#{torn_samples} of #{total} samples have a caller at the wrong line:\n" \
                            "expected: #{expected.map(&:to_s).join(" <- ")}\n#{torn.map(&:last).first(10).join("\n")}"
    expect(bad).to be_empty,
                   "#{bad.size} of #{in_work.size} distinct stacks in Inner#work (#{total} samples) " \
                   "differ from Ruby's own (#{jit || "no JIT"}):\n" \
                   "expected: #{expected.map(&:to_s).join(" <- ")}\n#{bad.first(10).join("\n")}"
  end

  it "without a JIT (the control) spreads the innermost line over the method's lines" do
    skip "#{ruby} runs a JIT: see the distribution printed by the other example" if ruby.jit

    target, jit, in_work, other = record_work
    skip "the target runs #{jit} although no JIT was asked for" if jit
    lines = report(target, jit, in_work, other)
    loop_body = (fixture_line(fixture, "WORK_LOOP") + 1)...fixture_line(fixture, "WORK_LAST")
    expect(lines.keys.count { |l| loop_body.cover?(l) }).to be >= 2, lines.inspect
  end
  # Sampled allocation tracking turns its NEWOBJ hook on around each sample. Under ZJIT (Ruby
  # 4.1) turning it on throws away every method compiled with an inline allocation; armed 25
  # times a second, a method called a few thousand times a second ran out of recompilations
  # and left compiled code at each allocation for good (35,000 such side exits in 3 s of this
  # fixture before the tracker held the hook on while ZJIT compiles: core/src/allocs/hold.rs).
  # YJIT compiles no allocation inline, and must throw nothing away either.
  it "tracks allocations in compiled code without throwing the code away" do
    skip "#{ruby} runs no JIT: see the JIT runs" unless ruby.jit
    skip "no rbspy_ext built for #{ruby}: run script/rubies ext #{ruby.name}" unless ruby.extension?

    flags = ruby.jit == "zjit" ? ["--zjit-stats-quiet"] : []
    command = ruby.command(*flags, File.join(RubySpyTest::FIXTURES, "alloc_rates.rb"), "jit", "-", "3")
    out, err, status = Open3.capture3(*command)
    raise "alloc_rates.rb jit failed: #{err}" unless status.success?

    result = JSON.parse(out.lines.last)
    skip "#{ruby} was asked for --#{ruby.jit} but the JIT is not on" unless result["jit"]
    if result["thrown"].nil?
      skip "#{ruby}'s ZJIT compiles no allocation inline (no NEWOBJ patch point)" if result["jit"] == "zjit"
      skip "#{ruby}'s YJIT counts invalidations only under --yjit-stats"
    end

    armed = result["stats"]["arms"] - result["settled"]["arms"]
    warn format("%s: %d armings in %.0f s of spaced calls; %d thrown away (%s); %d methods compiled; " \
                "holds %d (%.0f ms)", ruby, armed, result["seconds"] - 1, result["thrown"], result["jit"],
                result["compiled"], result["stats"].fetch("holds", 0), result["stats"].fetch("held_ms", 0))
    # The hook went on and off again and again while the sites' methods were compiled and ran.
    expect(armed).to be >= 20, result.slice("settled", "stats").inspect
    # A few exits may come from code on the stack when an arming throws it away; methods
    # that ran out of recompilations gave tens of thousands.
    expect(result["thrown"]).to be < 100, result.inspect
    # Allocations made by compiled code are all sampled: the estimates add up to what
    # GC.stat counted, within the error the samples allow (Poisson, 4.5 standard errors).
    n = result["all_samples"]
    expect((result["estimated"] - result["objects"]).abs).to be < 4.5 * result["objects"] / Math.sqrt(n),
                                                              result.slice("estimated", "objects", "all_samples").inspect
  end
end
