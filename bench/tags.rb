# frozen_string_literal: true

# What fiber context costs the tagged process (run by hand; figures go in notes, not tests):
#
#   rake compile && ruby bench/tags.rb          (ROUNDS=N alternations, default 7)
#
# - a Fiber resume/yield loop in a fresh Ruby: without rbspy_ext; with an empty
#   RUBY_EVENT_FIBER_SWITCH hook (bench/empty_hook, built here with mkmf: the floor any such
#   hook pays for Ruby calling it); with rbspy_ext loaded but never tagged (no hook yet); with
#   its hook installed and the fiber untagged; with the fiber tagged (the same tags as the
#   main fiber: the hook finds the table unchanged); and with the two fibers tagged apart, so
#   every switch publishes another table and retires the one before (state.rs keeps retired
#   tables alive for readers a while). The cases alternate
#   ROUNDS times, each in a fresh process, and each figure is the best round: on the VM this
#   was written on the same loop runs at either ~60 or ~92 ns per switch depending on the
#   process (bimodal, whatever the case), so a median mixes the two modes and the best
#   compares like with like;
# - the cost of one `RubySpy.tag(...) { }` and one `RubySpy.tags`.
require "rbconfig"
require "fileutils"
require "tmpdir"

LIB = File.expand_path("../lib", __dir__)
SWITCHES = Integer(ENV.fetch("SWITCHES", 2_000_000))
ROUNDS = Integer(ENV.fetch("ROUNDS", 7))

def fiber_loop(setup, load_path = LIB, inner: "")
  code = <<~RUBY
    #{setup}
    f = Fiber.new { #{inner}; loop { Fiber.yield } }
    run = -> { t = Process.clock_gettime(Process::CLOCK_MONOTONIC); #{SWITCHES / 2}.times { f.resume }; Process.clock_gettime(Process::CLOCK_MONOTONIC) - t }
    run.call
    best = Array.new(5) { run.call }.min
    puts best
  RUBY
  Float(IO.popen([RbConfig.ruby, "-I", LIB, "-I", load_path, "-e", code], &:read))
end

hook_dir = Dir.mktmpdir("empty_hook")
at_exit { FileUtils.rm_rf(hook_dir) }
Dir.chdir(hook_dir) do
  # mkmf takes the sources from the extconf's own directory and builds here.
  system(RbConfig.ruby, File.expand_path("empty_hook/extconf.rb", __dir__), out: File::NULL) &&
    system("make", out: File::NULL) or abort "could not build bench/empty_hook (needs ruby-dev and a C compiler)"
end

CASES = {
  plain: ["", "without rbspy_ext"],
  empty: ['require "empty_hook"; EmptyFiberSwitchHook.install', "an empty hook (the floor)"],
  loaded: ['require "rbspy_ext"; raise if RubySpy::State.hook_installed?', "rbspy_ext, never tagged"],
  hooked: ['require "rbspy_ext"; RubySpy.tag(x: 1) {}; raise unless RubySpy::State.hook_installed?',
           "rbspy_ext hook, fiber untagged"],
  tagged: ['require "rbspy_ext"; RubySpy::State.new(request_id: "abc", user: 42).apply!',
           "rbspy_ext hook, fiber tagged"],
  apart: ['require "rbspy_ext"; RubySpy::State.new(request_id: "abc", user: 42).apply!',
          "rbspy_ext hook, fibers tagged apart", 'RubySpy::State.new(request_id: "def", user: 7).apply!'],
}.freeze
times = Hash.new { |h, k| h[k] = [] }
ROUNDS.times { CASES.each { |name, (setup, _, inner)| times[name] << fiber_loop(setup, hook_dir, inner: inner.to_s) } }
best = times.transform_values(&:min)
ns = ->(s) { s * 1e9 / SWITCHES }
CASES.each do |name, (_, title)|
  puts format("fiber switch, %-31s %6.1f ns (%+.1f%%)", "#{title}:", ns.(best[name]),
              100 * (best[name] / best[:plain] - 1))
end
puts format("rbspy_ext's own work beyond an empty hook: %.1f ns untagged, %.1f ns tagged",
            ns.(best[:hooked] - best[:empty]), ns.(best[:tagged] - best[:empty]))

$LOAD_PATH.unshift LIB
require "rbspy_ext"
def per_call(n)
  yield # warm
  t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
  n.times { yield }
  (Process.clock_gettime(Process::CLOCK_MONOTONIC) - t) * 1e9 / n
end
n = 500_000
puts format("RubySpy.tag(request_id:, user:) { }: %.0f ns", per_call(n) { RubySpy.tag(request_id: "abc", user: 42) {} })
RubySpy.tag(outer: 1) do
  puts format("nested RubySpy.tag(request_id:) { }: %.0f ns", per_call(n) { RubySpy.tag(request_id: "abc") {} })
end
puts format("RubySpy.tags:                      %.0f ns", per_call(n) { RubySpy.tags })
