# frozen_string_literal: true

# What fiber context costs the tagged process (run by hand; figures go in notes, not tests):
#
#   rake compile && ruby bench/tags.rb
#
# - a Fiber resume/yield loop in a fresh Ruby without rbspy_ext, and with it loaded (its
#   RUBY_EVENT_FIBER_SWITCH hook publishing each fiber's table), with and without tags;
# - the cost of one `RubySpy.tag(...) { }` and one `RubySpy.tags`.
require "rbconfig"

LIB = File.expand_path("../lib", __dir__)
SWITCHES = Integer(ENV.fetch("SWITCHES", 2_000_000))

def fiber_loop(setup)
  code = <<~RUBY
    #{setup}
    f = Fiber.new { loop { Fiber.yield } }
    run = -> { t = Process.clock_gettime(Process::CLOCK_MONOTONIC); #{SWITCHES / 2}.times { f.resume }; Process.clock_gettime(Process::CLOCK_MONOTONIC) - t }
    run.call
    best = Array.new(5) { run.call }.min
    puts best
  RUBY
  Float(IO.popen([RbConfig.ruby, "-I", LIB, "-e", code], &:read))
end

plain = fiber_loop("")
hooked = fiber_loop('require "rbspy_ext"')
tagged = fiber_loop('require "rbspy_ext"; RubySpy::State.new(request_id: "abc", user: 42).apply!')
ns = ->(s) { s * 1e9 / SWITCHES }
puts format("fiber switch without rbspy_ext: %.1f ns", ns.(plain))
puts format("fiber switch with the hook:     %.1f ns (%+.1f%%)", ns.(hooked), 100 * (hooked / plain - 1))
puts format("... and the fiber tagged:       %.1f ns (%+.1f%%)", ns.(tagged), 100 * (tagged / plain - 1))

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
