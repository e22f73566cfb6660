# frozen_string_literal: true

# How exact our frames are, per target Ruby: the snapshot spec's corpus and a JIT-compiled
# hot loop, one row per Ruby, in one table.
#
#   ruby bench/rubies.rb                              # host + every `script/rubies list` Ruby
#   ruby bench/rubies.rb host 4.0:outside:yjit 3.2    # a subset (a bare NAME: all its modes)
#
# Run from the repository root as root (inside-mode targets are chrooted; reading another
# process's memory needs ptrace rights), after `rake compile` and `script/rubies build`.
# A Ruby is named as RUBYSPY_TARGET_RUBY names it (spec/support/target_ruby.rb): NAME:inside|outside
# with an optional :yjit or :zjit, or `host`.
#
# Per Ruby:
# - corpus: every fixture of spec/snapshot_spec.rb's parked_scenarios is started, snapshotted
#   once and compared with the backtrace_locations it recorded of itself. Frames are aligned on
#   who they are (label and path) so that one missing or extra frame costs one frame, not every
#   frame after it; an aligned frame is exact when its line and absolute path match too.
#   Labels are compared as the specs compare them (FrameComparison.label_matches?: Ruby < 3.4
#   prints unqualified labels).
# - JIT loop: spec/fixtures/jit_spin.rb is recorded for 2 s at 499 Hz (not a divisor of the
#   target's timer ticks), and over the main thread's samples in Inner#work: how many have
#   every caller frame exactly as Ruby recorded it, how many put the innermost line inside
#   Inner#work (a JIT writes the pc only at calls and side exits, so that line may lag, but
#   never leave the method), and how the innermost line spreads (a stuck pc shows as one line
#   at 100%).
#
# Each Ruby runs in a child process (`ruby bench/rubies.rb --one SPEC`, its own process
# group), so that TargetRuby's per-process choice of Ruby stays as the specs use it, and a
# Ruby that crashes, hangs or fails to attach gives a row with its error rather than ending
# the run. The child prints one JSON line; the parent kills the group on a timeout.
$LOAD_PATH.unshift File.expand_path("../lib", __dir__)
require "json"
require "rbconfig"
require "tmpdir"

ROOT = File.expand_path("..", __dir__)
RESULT_PREFIX = "RUBIES-RESULT "
# Per Ruby: 20 fixtures (a chrooted Ruby boots in ~0.3 s) and the 2.5 s JIT loop fit in a
# fraction of this; a Ruby that takes longer is stuck.
CHILD_TIMEOUT = Integer(ENV.fetch("TIMEOUT", 300))
# The JIT variants worth a row beside the plain Rubies (YJIT from 3.2, ZJIT from 4.0).

# ---------------------------------------------------------------------------------------
# The child: measures one Ruby and prints its result.

# The fixture names of spec/snapshot_spec.rb's parked_scenarios hash, read out of the spec's
# source: the spec cannot be loaded without running RSpec, and a copy here would drift.
def parked_scenarios
  source = File.read(File.join(ROOT, "spec", "snapshot_spec.rb"))
  body = source[/^parked_scenarios = \{\n(.*?)^\}/m, 1] or raise "no parked_scenarios hash in spec/snapshot_spec.rb"
  names = body.scan(/^\s*"(\w+)" =>/).flatten
  raise "parked_scenarios in spec/snapshot_spec.rb lists no fixtures" if names.empty?

  names
end

def load_spec_support
  # spec/support/frames.rb ends by defining an RSpec matcher; rspec-expectations alone
  # provides RSpec::Matchers.define without starting RSpec. Without it, a stand-in.
  begin
    require "rspec/expectations"
  rescue LoadError
    Object.const_set(:RSpec, Module.new)
    RSpec.const_set(:Matchers, Module.new { def self.define(*); end })
  end
  require File.join(ROOT, "spec", "support", "target")
  require File.join(ROOT, "spec", "support", "frames")
end

def monotonic
  Process.clock_gettime(Process::CLOCK_MONOTONIC)
end

def error_text(error)
  "#{error.class}: #{error.message.lines.first.to_s.strip}"
end

# Pairs actual with expected frames, in order, on who they are (label and path), preferring
# pairs that are also exact: a weighted longest common subsequence. Returns
# [exact pairs, pairs, missing (expected unpaired), extra (actual unpaired)].
def align(actual, expected, version)
  fc = RubySpyTest::FrameComparison
  score = lambda do |a, e|
    next 0 unless a.path == e.path && fc.label_matches?(a.label, e.label, version)

    a.lineno == e.lineno && a.absolute_path == e.absolute_path ? 3 : 2
  end
  n = actual.size
  m = expected.size
  best = Array.new(n + 1) { Array.new(m + 1, 0) }
  (n - 1).downto(0) do |i|
    (m - 1).downto(0) do |j|
      s = score.call(actual[i], expected[j])
      pair = s.zero? ? 0 : s + best[i + 1][j + 1]
      best[i][j] = [pair, best[i + 1][j], best[i][j + 1]].max
    end
  end
  i = j = exact = pairs = 0
  while i < n && j < m
    s = score.call(actual[i], expected[j])
    if s.positive? && best[i][j] == s + best[i + 1][j + 1]
      pairs += 1
      exact += 1 if s == 3
      i += 1
      j += 1
    elsif best[i][j] == best[i + 1][j]
      i += 1
    else
      j += 1
    end
  end
  [exact, pairs, m - pairs, n - pairs]
end

def measure_corpus(ruby)
  out = { exact: 0, total: 0, missing: 0, extra: 0, fixtures: 0, imperfect: [], errors: [] }
  parked_scenarios.each do |name|
    target = nil
    begin
      target = RubySpyTest::Target.start(name, ruby: ruby)
      expected = target.frames
      out[:total] += expected.size
      begin
        frames = RubySpy.snapshot(target.pid)
      rescue StandardError => e
        out[:missing] += expected.size # nothing read counts as every frame missing
        out[:errors] << "#{name}: #{error_text(e)}"
        next
      end
      exact, _pairs, missing, extra = align(frames, expected, target.ruby_version)
      out[:fixtures] += 1
      out[:exact] += exact
      out[:missing] += missing
      out[:extra] += extra
      out[:imperfect] << "#{name} #{exact}/#{expected.size}" if exact < expected.size || extra.positive?
      out[:version] ||= target.ruby_version
    rescue StandardError => e
      out[:errors] << "#{name}: #{error_text(e)}" # failed to start: not counted
    ensure
      target&.stop
    end
  end
  out
end

def fixture_line(name, marker)
  path = File.join(ROOT, "spec", "fixtures", "#{name}.rb")
  index = File.readlines(path).index { |line| line.include?("# #{marker}") } or raise "no # #{marker} in #{path}"
  index + 1
end

def measure_jit_loop(ruby)
  work_range = fixture_line("jit_spin", "WORK_DEF")..fixture_line("jit_spin", "WORK_END")
  work_frame = ->(f) { f && f.base_label == "work" && f.path.to_s.end_with?("fixtures/jit_spin.rb") }
  target = RubySpyTest::Target.start("jit_spin", ruby: ruby)
  out = { version: target.ruby_version, jit: target.info["jit"], asked: ruby.jit }
  expected = target.frames
  profile = RubySpy::Recorder.new(target.pid, rate: 499, duration: 2.0, threads: :all).start.wait.stop
  out[:dropped] = profile.errors
  out[:health] = target.health_problems
  main = profile.threads.index { |t| t[:main] }
  mine = main ? profile.stacks.select { |s| s[:thread] == main } : []
  out[:main_samples] = mine.sum { |s| s[:samples] }
  in_work = mine.select { |s| s[:frames].any?(&work_frame) }
  out[:samples] = in_work.sum { |s| s[:samples] }
  if out[:samples].zero?
    out[:error] = "no main-thread samples in Inner#work (#{profile.samples} samples in all, " \
                  "dropped #{profile.errors.inspect})"
    return out
  end

  fc = RubySpyTest::FrameComparison
  callers_exact = within = 0
  lines = Hash.new(0)
  in_work.each do |stack|
    # C frames on top (YJIT on 3.2 calls Integer#* as a C method) are set aside, as
    # spec/jit_spec.rb does: Ruby's own backtrace would show them too.
    frames = stack[:frames].drop_while(&:c_function?)
    n = stack[:samples]
    innermost = frames.first
    lines[innermost.lineno] += n
    within += n if work_frame.call(innermost) && work_range.cover?(innermost.lineno)
    exact = frames.size == expected.size &&
            (1...expected.size).all? do |i|
              a = frames[i]
              e = expected[i]
              fc.label_matches?(a.label, e.label, out[:version]) && a.path == e.path && a.lineno == e.lineno
            end
    callers_exact += n if exact
  end
  top_line, top = lines.max_by { |_, v| v }
  out.merge(callers_exact: callers_exact, within: within, distinct_lines: lines.size,
            top_line: top_line, top_share: top.to_f / out[:samples])
rescue StandardError => e
  (out || {}).merge(error: error_text(e))
ensure
  target&.stop
end

def run_one(spec)
  result = { spec: spec }
  begin
    if spec == "host"
      ENV.delete("RUBYSPY_TARGET_RUBY")
    else
      ENV["RUBYSPY_TARGET_RUBY"] = spec
    end
    load_spec_support
    require "rbspy_ext"
    ruby = RubySpyTest::TargetRuby.current
    result[:version] = ruby.version.to_s
    result[:corpus] = measure_corpus(ruby)
    result[:jit_loop] = measure_jit_loop(ruby)
  rescue StandardError, LoadError => e
    result[:error] = error_text(e)
  end
  $stdout.puts RESULT_PREFIX + JSON.generate(result)
end

# ---------------------------------------------------------------------------------------
# The parent: one child per Ruby, then the table.

# `script/rubies list`: [[NAME, VERSION, KIND, JITS], ...] (KIND chroot, source,
# source-unknown or extra; JITS "yjit,zjit" or "-").
def listed_rubies
  IO.popen([File.join(ROOT, "script", "rubies"), "list"], err: File::NULL, &:read).lines
    .map(&:split).map { |f| [f[0], f[1], f[4], f[5].to_s] }
rescue SystemCallError
  []
end

# Every mode of a listed Ruby (chroot Rubies run inside and outside, the others only
# outside), followed by one per JIT it has.
def modes_of(name, kind, jits = "-")
  base = kind == "chroot" ? ["#{name}:inside", "#{name}:outside"] : ["#{name}:outside"]
  base + (jits.split(",") - ["-"]).map { |jit| "#{name}:outside:#{jit}" }
end

def specs_from(args)
  listed = listed_rubies
  return ["host"] + listed.flat_map { |name, _, kind, jits| modes_of(name, kind, jits) } if args.empty?

  args.flat_map do |arg|
    next [arg] if arg == "host" || arg.include?(":")

    entry = listed.find { |name, _, _| name == arg }
    entry ? modes_of(entry[0], entry[2], entry[3]) : [arg] # an unknown name: the child reports it
  end
end

def run_child(spec)
  Dir.mktmpdir("rbspy-rubies-") do |dir|
    out = File.join(dir, "out")
    err = File.join(dir, "err")
    pid = Process.spawn(RbConfig.ruby, __FILE__, "--one", spec, chdir: ROOT, pgroup: true,
                                                                 in: File::NULL, out: out, err: err)
    begin
      deadline = monotonic + CHILD_TIMEOUT
      status = nil
      until (status = Process.wait2(pid, Process::WNOHANG)&.last)
        if monotonic > deadline
          Process.kill(:KILL, -pid) rescue nil # the child's group: it and its targets
          Process.wait(pid) rescue nil
          pid = nil
          return { spec: spec, error: "timed out after #{CHILD_TIMEOUT} s" }
        end
        sleep 0.1
      end
      pid = nil
      line = File.readlines(out).reverse.find { |l| l.start_with?(RESULT_PREFIX) }
      next JSON.parse(line.delete_prefix(RESULT_PREFIX), symbolize_names: true) if line

      tail = File.read(err).lines.last(3).map(&:strip).join(" | ")
      { spec: spec, error: "child #{status.inspect}: #{tail}" }
    ensure
      if pid # interrupted: take the child's targets down with it
        Process.kill(:KILL, -pid) rescue nil
        Process.wait(pid) rescue nil
      end
    end
  end
end

def percent(part, whole)
  format("%.1f%%", 100.0 * part / whole)
end

def row_for(r)
  version = r[:version] || r.dig(:corpus, :version) || "?"
  return [r[:spec], version, "error: #{r[:error]}"] if r[:error]

  c = r[:corpus]
  j = r[:jit_loop]
  jit = j[:jit] || "-"
  jit = "OFF (#{j[:asked]} asked)" if j[:asked] && j[:jit].nil?
  corpus = "#{c[:exact]}/#{c[:total]}"
  corpus += " (#{c[:errors].size} failed)" unless c[:errors].empty?
  cells = [r[:spec], j[:version] || c[:version] || version, corpus, "#{c[:missing]}/#{c[:extra]}"]
  if j[:error]
    cells + [jit, j[:samples] ? "#{j[:samples]}/#{j[:main_samples]}" : "-", "error: #{j[:error]}"]
  else
    cells + [jit, "#{j[:samples]}/#{j[:main_samples]}", percent(j[:callers_exact], j[:samples]),
             percent(j[:within], j[:samples]),
             "#{j[:distinct_lines]} / #{percent(j[:top_share], 1)} at #{j[:top_line]}"]
  end
end

def print_table(results)
  header = ["Ruby", "version", "corpus exact", "miss/extra", "JIT on", "loop samples",
            "callers exact", "innermost in method", "distinct lines / top share"]
  rows = results.map { |r| row_for(r) }
  # An error cell runs to the end of its row; widths come from the full rows.
  widths = header.each_index.map do |i|
    ([header] + rows).map { |row| row.size == header.size || i < row.size - 1 ? row[i].to_s.length : 0 }.max
  end
  fmt = ->(row) { row.each_with_index.map { |cell, i| i == row.size - 1 ? cell.to_s : cell.to_s.ljust(widths[i]) }.join("  ") }
  puts fmt.call(header)
  puts widths.map { |w| "-" * w }.join("  ")
  rows.each { |row| puts fmt.call(row) }
end

# What the table leaves out: fixtures that were not exact, errors, dropped samples.
def print_notes(results)
  notes = results.flat_map do |r|
    c = r[:corpus] || {}
    j = r[:jit_loop] || {}
    list = []
    list << "corpus not exact: #{c[:imperfect].join(', ')}" unless c[:imperfect].to_a.empty?
    list.concat(c[:errors].to_a.map { |e| "corpus error: #{e}" })
    list << "JIT loop dropped samples: #{j[:dropped]}" unless j[:dropped].to_h.empty?
    list << "JIT loop target unhealthy: #{j[:health].join('; ')}" unless j[:health].to_a.empty?
    list.map { |l| "  #{r[:spec]}: #{l}" }
  end
  return if notes.empty?

  puts
  puts "Notes:"
  puts notes
end

if ARGV.first == "--one"
  run_one(ARGV.fetch(1))
  exit
end

Dir.chdir(ROOT)
specs = specs_from(ARGV)
results = specs.map do |spec|
  warn "bench/rubies.rb: #{spec}"
  run_child(spec)
end
puts
print_table(results)
print_notes(results)
puts
puts "Corpus: the #{parked_scenarios.size} parked fixtures of spec/snapshot_spec.rb, one snapshot each, frames aligned " \
     "on label+path; exact = line and absolute path too. Loop: spec/fixtures/jit_spin.rb, 2 s at 499 Hz, " \
     "main-thread samples in Inner#work."
puts "Reproduce: ruby bench/rubies.rb [SPEC...]   (SPEC: host, NAME, NAME:inside|outside[:yjit|:zjit])"
