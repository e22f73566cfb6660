# frozen_string_literal: true

# What the Rails integration costs a request: a trivial action (spec/fixtures/rails_app/overlay,
# HelloController#show) served by Puma with the Railtie's default tags on, and with
# config.rubyspy.tags = false. Two figures per side:
# - requests per second seen by one keep-alive client;
# - the server's CPU time per request (the sum of /proc/PID/task/*/schedstat), which the
#   client's own noise does not reach.
# Each pair of servers is measured in alternating windows, so drift in the machine's speed hits
# both alike; several pairs are started, because two processes of one program differ by a few
# per cent in speed from their memory layout alone (an A/A run shows it).
#
#   rake compile && ruby bench/rails.rb [PAIRS] [ROUNDS] [SECONDS]
#   RUBYSPY_BENCH_AA=1 ruby bench/rails.rb ...   # both sides without tags: the noise floor
#
# Prints each pair's medians and the median over pairs; the target is < 2 % with tags.
$LOAD_PATH.unshift File.expand_path("../lib", __dir__)
require "net/http"
require "socket"
require "tmpdir"

ROOT = File.expand_path("..", __dir__)
pairs = Integer(ARGV.fetch(0, "3"))
rounds = Integer(ARGV.fetch(1, "6"))
window = Float(ARGV.fetch(2, "2"))
aa = ENV["RUBYSPY_BENCH_AA"] == "1"

# The app spec/rails_spec.rb serves: `rails new` plus spec/fixtures/rails_app/overlay, with
# rbspy_ext in its Gemfile.
def generate_app(dir)
  app = File.join(dir, "rails_app")
  system(RbConfig.ruby, File.join(ROOT, "spec/fixtures/rails_app/generate"), app, exception: true)
  app
end

def start_puma(dir, app, name, tags)
  port = TCPServer.open("127.0.0.1", 0) { |s| s.addr[1] }
  env = { "PORT" => port.to_s, "PIDFILE" => File.join(dir, "#{name}.pid"), "BUNDLE_GEMFILE" => File.join(app, "Gemfile"),
          "RAILS_ENV" => "production", "RUBYSPY_TAGS" => tags ? "1" : "0", "RUBYSPY_EXTRA_TAGS" => "0" }
  # On CPU 1, with the client (this process) on CPU 0: the two sides then never share a core
  # with the client, nor wander between cores mid-window.
  pid = Process.spawn(env, "taskset", "-c", "1", "bundle", "exec", "puma", "-C", File.join(ROOT, "spec/fixtures/puma.rb"),
                      File.join(app, "config.ru"), chdir: app, out: File::NULL, err: File::NULL, pgroup: true)
  http = nil
  60.times do
    http = Net::HTTP.start("127.0.0.1", port)
    break if http.get("/hello").code == "200"
  rescue SystemCallError
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

def median(values)
  s = values.sort
  s.size.odd? ? s[s.size / 2] : (s[s.size / 2 - 1] + s[s.size / 2]) / 2.0
end

Dir.mktmpdir do |dir|
  app = generate_app(dir)
  system("taskset", "-pc", "0", Process.pid.to_s, out: File::NULL, exception: true)
  cost = { rps: [], cpu: [] }
  pairs.times do |p|
    sides = { tags: start_puma(dir, app, "tags#{p}", !aa), none: start_puma(dir, app, "none#{p}", false) }
    begin
      sides.each_value { |side| measure(side, 1) } # warm up
      results = Hash.new { |h, k| h[k] = { rps: [], cpu: [] } }
      rounds.times do |i|
        (i.even? ? %i[tags none] : %i[none tags]).each do |name|
          rps, cpu = measure(sides[name], window)
          results[name][:rps] << rps
          results[name][:cpu] << cpu
        end
      end
      with = results[:tags].transform_values { |v| median(v) }
      without = results[:none].transform_values { |v| median(v) }
      cost[:rps] << (1 - with[:rps] / without[:rps]) * 100
      cost[:cpu] << (with[:cpu] / without[:cpu] - 1) * 100
      printf("pair %d: %.0f vs %.0f requests/s (%+.2f %%); server CPU %.1f vs %.1f us a request (%+.2f %%)\n",
             p + 1, with[:rps], without[:rps], cost[:rps].last, with[:cpu], without[:cpu], cost[:cpu].last)
    ensure
      sides.each_value { |side| stop_puma(side) }
    end
  end
  printf("%s, median over %d pairs: %.2f %% fewer requests/s, %.2f %% more server CPU a request\n",
         aa ? "A/A (no tags on either side)" : "tags on vs off", pairs, median(cost[:rps]), median(cost[:cpu]))
end
