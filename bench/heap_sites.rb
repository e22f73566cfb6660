# frozen_string_literal: true

# What `rubyspy heap --by site` adds to a census (issue 38): a target that tracks its
# allocations at the default rate (512 KiB) keeps OBJECTS Objects from ten sites, collects,
# and waits until its tracker has published; then censuses with and without sites run in
# turns, RUNS of each, and the medians are printed with what the sites read (samples still
# there, the published blob's size).
#
#   rake compile && ruby bench/heap_sites.rb            (OBJECTS=10000000 RUNS=7)
#   TARGET_RUBY=/opt/srcrubies/4.0/bin/ruby ruby bench/heap_sites.rb   (after script/rubies ext 4.0)
#
# Run from the repository root, as root (process_vm_readv).
$LOAD_PATH.unshift File.expand_path("../lib", __dir__)
require "rbspy_ext"
require "open3"

OBJECTS = Integer(ENV.fetch("OBJECTS", "10000000"))
RUNS = Integer(ENV.fetch("RUNS", "7"))
TARGET_RUBY = ENV.fetch("TARGET_RUBY", RbConfig.ruby)

TARGET = <<~RUBY
  $LOAD_PATH.unshift #{File.expand_path("../lib", __dir__).inspect}
  require "rbspy_ext"
  RubySpy.track_allocations
  KEEP = []
  10.times do |site|
    Object.send(:define_method, "keep_\#{site}") { |n| n.times { KEEP << Object.new } }
    send("keep_\#{site}", #{OBJECTS} / 10)
  end
  GC.start
  collected = (Time.now.to_r * 1000).floor
  until (RubySpy::NativeAllocations.published_at_ms || 0) > collected
    Object.new
    sleep 0.05
  end
  puts "ready"
  $stdout.flush
  sleep
RUBY

def median(values)
  values.sort[values.size / 2]
end

Open3.popen2(TARGET_RUBY, "-e", TARGET) do |_stdin, out, wait|
  out.gets
  pid = wait.pid
  plain = []
  joined = []
  census = nil
  RUNS.times do
    t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    RubySpy.heap(pid)
    plain << Process.clock_gettime(Process::CLOCK_MONOTONIC) - t
    t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    census = RubySpy.heap(pid, sites: true)
    joined << Process.clock_gettime(Process::CLOCK_MONOTONIC) - t
  end
  Process.kill(:KILL, pid)
  sites = census.sites || abort("no sites: #{census.sites_note}")
  object = sites.find { |c| c[:name] == "Object" }
  estimate = object[:sites].sum { |s| s[:objects] }
  samples = sites.sum { |c| c[:sites].sum { |s| s[:samples] } }
  puts format("Ruby %<v>s, %<n>d live objects: census %<a>.1f ms, with sites %<b>.1f ms (+%<d>.1f ms), " \
              "median of %<r>d; %<s>d samples still there; Objects %<o>d, estimated from sites %<e>d (%<p>+.1f %%)",
              v: census.ruby_version, n: census.objects, a: median(plain) * 1000, b: median(joined) * 1000,
              d: (median(joined) - median(plain)) * 1000, r: RUNS, s: samples, o: object[:objects], e: estimate,
              p: 100.0 * (estimate - object[:objects]) / object[:objects])
end
