# frozen_string_literal: true

# What the Rails integration costs a request: a trivial action (spec/fixtures/rails_app/overlay,
# HelloController#show) served by Puma with the Railtie's default tags, in alternating windows
# with the tags on and off (RubySpy::Railtie.enabled, flipped through a route the app has only
# under RUBYSPY_BENCH=1) inside one server process. Two figures per window:
# - requests per second seen by one keep-alive client;
# - the server's CPU time per request (the sum of /proc/PID/task/*/schedstat), which the
#   client's own noise does not reach.
#
# Why one process: two processes of one program differ here by up to 10 % in speed from
# nothing but where they landed in memory (RUBYSPY_BENCH_PAIRS=1 measures a pair of servers,
# one with config.rubyspy.tags = false, to see it), which buries a 2 % target.
# RUBYSPY_BENCH_AA=1 leaves the tags off on both sides: what the method reads with no change. Switched off, the Railtie's hooks still run and
# check the flag (two method calls, well under 1 us), so the figure slightly understates the cost.
#
#   rake compile && ruby bench/rails.rb [SERVERS] [ROUNDS] [SECONDS]   # default 3 10 1
#   RUBYSPY_BENCH_CALLGRIND=1 ruby bench/rails.rb [ROUNDS] [REQUESTS]  # default 3 300
#
# Prints each server's medians, then the median over servers; the target is < 2 % with tags.
#
# Time on a shared VM swings by several per cent from one second to the next, so
# RUBYSPY_BENCH_CALLGRIND=1 counts instructions instead, which do not: one Puma under
# valgrind's callgrind (installed with apt-get if missing; instrumentation off while Rails
# boots), then
# REQUESTS requests per window with the tags on and off in turn, each window's instructions
# (every thread of the server) read from callgrind's dump. Instructions are not time (cache
# misses and allocation cost more than their count), but they show what the tags add to the
# work of a request, reproducibly to a tenth of a per cent.
$LOAD_PATH.unshift File.expand_path("../lib", __dir__)
require "net/http"
require "socket"
require "tmpdir"

ROOT = File.expand_path("..", __dir__)
servers = Integer(ARGV.fetch(0, "3"))
rounds = Integer(ARGV.fetch(1, "10"))
window = Float(ARGV.fetch(2, "1"))
pairs = ENV["RUBYSPY_BENCH_PAIRS"] == "1"
aa = ENV["RUBYSPY_BENCH_AA"] == "1"

# The app spec/rails_spec.rb serves: `rails new` plus spec/fixtures/rails_app/overlay, with
# rbspy_ext in its Gemfile.
def generate_app(dir)
  app = File.join(dir, "rails_app")
  system(RbConfig.ruby, File.join(ROOT, "spec/fixtures/rails_app/generate"), app, exception: true)
  app
end

def start_puma(dir, app, name, tags, wrap: %w[taskset -c 1])
  port = TCPServer.open("127.0.0.1", 0) { |s| s.addr[1] }
  env = { "PORT" => port.to_s, "PIDFILE" => File.join(dir, "#{name}.pid"), "BUNDLE_GEMFILE" => File.join(app, "Gemfile"),
          "RAILS_ENV" => "production", "RUBYSPY_TAGS" => tags ? "1" : "0", "RUBYSPY_EXTRA_TAGS" => "0",
          "RUBYSPY_BENCH" => "1" }
  # By default on CPU 1, with the client (this process) on CPU 0: the server never shares a
  # core with the client, nor wanders between cores mid-window. Ruby runs directly (Bundler
  # set up by -rbundler/setup), so that a wrapper such as valgrind sees Puma itself.
  pid = Process.spawn(env, *wrap, RbConfig.ruby, "-rbundler/setup", "-S", "puma", "-C", File.join(ROOT, "spec/fixtures/puma.rb"),
                      File.join(app, "config.ru"), chdir: app, out: File::NULL, err: File::NULL, pgroup: true)
  http = nil
  240.times do
    http = Net::HTTP.start("127.0.0.1", port, read_timeout: 120)
    break if http.get("/hello").code == "200"
  rescue SystemCallError
    http = nil
    sleep 0.5
  end
  abort "puma did not start" unless http
  { pid: pid, server: Integer(File.read(File.join(dir, "#{name}.pid"))), http: http }
end

def stop_puma(side)
  Process.kill(:TERM, -side[:pid])
  Process.wait(side[:pid])
rescue SystemCallError
  nil
end

# Nanoseconds the process's threads have run, from the scheduler's own accounting.
def cpu_ns(pid)
  Dir.glob("/proc/#{pid}/task/*/schedstat").sum { |f| File.read(f).split.first.to_i }
rescue Errno::ENOENT, Errno::ESRCH
  retry
end

# [requests per second, server CPU microseconds per request] over one window.
def measure(side, seconds)
  n = 0
  cpu = cpu_ns(side[:server])
  started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
  deadline = started + seconds
  while Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
    raise "bad response" unless side[:http].get("/hello").code == "200"

    n += 1
  end
  elapsed = Process.clock_gettime(Process::CLOCK_MONOTONIC) - started
  [n / elapsed, (cpu_ns(side[:server]) - cpu) / 1e3 / n]
end

def switch(side, on)
  body = side[:http].get("/bench/tags/#{on ? 'on' : 'off'}").body
  raise "the server did not switch its tags #{on ? 'on' : 'off'}: #{body.inspect}" unless body == "#{on}\n"

  side
end

def median(values)
  s = values.sort
  s.size.odd? ? s[s.size / 2] : (s[s.size / 2 - 1] + s[s.size / 2]) / 2.0
end

# Alternating windows on the two sides, each {tags:, none:} => a callable that readies the side
# and returns what to measure; [with, without] medians of [requests/s, CPU us a request].
def alternate(sides, rounds, window)
  sides.each_value { |ready| measure(ready.call, 1) } # warm up
  results = { tags: [], none: [] }
  rounds.times do |i|
    (i.even? ? %i[tags none] : %i[none tags]).each { |name| results[name] << measure(sides[name].call, window) }
  end
  results.values_at(:tags, :none).map { |r| [median(r.map(&:first)), median(r.map(&:last))] }
end

# Instructions per request with the tags on and off, in one Puma under callgrind.
def callgrind(dir, app, rounds, requests)
  unless system("which", "callgrind_control", out: File::NULL)
    warn "bench/rails.rb: installing valgrind (apt-get) for callgrind"
    system("apt-get", "install", "-y", "-qq", "valgrind", out: File::NULL) or abort "apt-get install valgrind failed"
  end
  out = File.join(dir, "callgrind.out")
  server = start_puma(dir, app, "callgrind", true,
                      wrap: %W[valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=#{out}])
  control = ->(*args) { system("callgrind_control", *args, server[:server].to_s, out: File::NULL, err: File::NULL, exception: true) }
  control.call("-i", "on")
  get = ->(n) { n.times { raise "bad response" unless server[:http].get("/hello").code == "200" } }
  get.call(100) # warm up, instrumented
  counts = { true => [], false => [] }
  rounds.times do |i|
    [i.even?, !i.even?].each do |on|
      switch(server, on)
      get.call(20)
      control.call("-z")
      get.call(requests)
      control.call("-d")
      dump = Dir.glob("#{out}.*").max_by { |f| File.mtime(f) }
      counts[on] << Integer(File.foreach(dump).grep(/\Asummary:/).first.split[1]) / requests.to_f
      File.delete(dump)
    end
  end
  with = median(counts[true])
  without = median(counts[false])
  printf("instructions a request, %d rounds of %d requests: %.0f with tags, %.0f without: %+.0f (%+.2f %%)\n",
         rounds, requests, with, without, with - without, (with / without - 1) * 100)
ensure
  stop_puma(server) if server
end

Dir.mktmpdir do |dir|
  app = generate_app(dir)
  if ENV["RUBYSPY_BENCH_CALLGRIND"] == "1"
    callgrind(dir, app, Integer(ARGV.fetch(0, "3")), Integer(ARGV.fetch(1, "300")))
    next
  end
  system("taskset", "-pc", "0", Process.pid.to_s, out: File::NULL, exception: true)
  cost = { rps: [], cpu: [] }
  servers.times do |n|
    if pairs
      # A pair; which side starts first alternates.
      order = n.even? ? %i[tags none] : %i[none tags]
      started = order.to_h { |name| [name, start_puma(dir, app, "#{name}#{n}", name == :tags && !aa)] }
      sides = started.transform_values { |side| -> { side } }
    else
      server = start_puma(dir, app, "server#{n}", true)
      started = { server: server }
      sides = { tags: -> { switch(server, !aa) }, none: -> { switch(server, false) } }
    end
    begin
      with, without = alternate(sides, rounds, window)
      cost[:rps] << (1 - with[0] / without[0]) * 100
      cost[:cpu] << (with[1] / without[1] - 1) * 100
      printf("%s %d: %.0f vs %.0f requests/s (%+.2f %%); server CPU %.1f vs %.1f us a request (%+.1f us, %+.2f %%)\n",
             pairs ? "pair" : "server", n + 1, with[0], without[0], cost[:rps].last, with[1], without[1],
             with[1] - without[1], cost[:cpu].last)
    ensure
      started.each_value { |side| stop_puma(side) }
    end
  end
  what = if aa then pairs ? "A/A (two servers, no tags on either)" : "A/A (tags off in both windows)"
         elsif pairs then "a server with tags vs one without"
         else "tags on vs off in the same server"
         end
  printf("%s, median over %d: %.2f %% fewer requests/s, %.2f %% more server CPU a request\n",
         what, servers, median(cost[:rps]), median(cost[:cpu]))
end
