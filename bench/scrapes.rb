# frozen_string_literal: true

# Scrapes of the pprof listener (RubySpy::Server) of a Rails app served by Puma in cluster
# mode (workers 2, `plugin :rubyspy`), under load from 4 clients, made the way a fleet agent
# makes them: `go tool pprof` fetching /debug/pprof/profile over plain HTTP.
#
#   ruby bench/scrapes.rb loop [TARGET]   # Alloy's rhythm: a 14 s profile every 15 s for 2 min
#   ruby bench/scrapes.rb many [TARGET]   # 200 sequential 1 s profiles, then 200 thread dumps
#   INTERVAL=15 TOTAL=120 COUNT=200 ruby bench/scrapes.rb ...
#
# TARGET is `trixie:inside` (the default: Rails 7.2, Puma 6.6, Ruby 3.3 in the trixie chroot)
# or `host` (Rails 6.1, Puma 5.6, Ruby 3.1). Run as root from the repository root after
# `rake compile`, `script/rubies build` and `script/rubies ext trixie`.
#
# Per scrape: the pids in it with their `worker` label, the samples of each action (endpoint
# tag) and the wall time the scrape took. Before and after: the listening process's (the Puma
# master's) RSS, open file descriptors and threads, which must stay flat.
mode = ARGV.fetch(0) { abort "usage: ruby bench/scrapes.rb loop|many [TARGET]" }
target = ARGV.fetch(1, "trixie:inside")
ENV["RUBYSPY_TARGET_RUBY"] = target unless target == "host"
$LOAD_PATH.unshift File.expand_path("../lib", __dir__)
require "rbspy_ext"
require_relative "../spec/support/target"
require_relative "../spec/support/servers"
require_relative "../spec/support/go_pprof"
include RubySpyTest::ServerHelpers # rubocop:disable Style/MixinUsage
include RubySpyTest::GoPprof # rubocop:disable Style/MixinUsage

# RSS (kB), open fds and threads of process +pid+.
def footprint(pid)
  rss = File.read("/proc/#{pid}/status")[/^VmRSS:\s+(\d+)/, 1].to_i
  { rss_kb: rss, fds: Dir.children("/proc/#{pid}/fd").size, threads: Dir.children("/proc/#{pid}/task").size }
end

def show_footprint(what, pid)
  sleep 0.5 # the last connection's thread ends just after its client has the answer
  f = footprint(pid)
  puts format("%-28s RSS %7d kB  fds %3d  threads %3d", what, f[:rss_kb], f[:fds], f[:threads])
  f
end

# One scrape of +seconds+: {pid => worker}, {endpoint => samples}, wall seconds.
def scrape(port, seconds)
  started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
  out = go_pprof("-traces", "-sample_index=samples", "http://127.0.0.1:#{port}/debug/pprof/profile?seconds=#{seconds}&rate=99")
  wall = Process.clock_gettime(Process::CLOCK_MONOTONIC) - started
  workers = {}
  endpoints = Hash.new(0)
  traces(out).each do |t|
    workers[t[:labels]["pid"][/\d+/].to_i] = t[:labels]["worker"]
    endpoints[t[:labels]["endpoint"] || "-"] += t[:value].to_i
  end
  [workers, endpoints, wall]
end

listen = RubySpyTest::Server.free_port
begin
  server = start_server("rails_app", env: { "RUBYSPY_WORKERS" => "2", "RUBYSPY_PPROF" => "127.0.0.1:#{listen}" })
rescue StandardError
  stop_servers # one that failed to boot is stopped too
  raise
end
puts "Rails #{server.rails_version} on #{RubySpyTest::TargetRuby.current}, master #{server.pid}, " \
     "workers #{server.workers.sort.join(', ')}; listener on 127.0.0.1:#{listen}"
begin
  under_load(server, ["/orders/7", "/invoices"], threads: 4, reconnect: true) do
    before = show_footprint("master before", server.pid)
    case mode
    when "loop"
      interval = Float(ENV.fetch("INTERVAL", "15"))
      total = Float(ENV.fetch("TOTAL", "120"))
      (total / interval).floor.times do |i|
        tick = Process.clock_gettime(Process::CLOCK_MONOTONIC)
        workers, endpoints, wall = scrape(listen, (interval - 1).to_i)
        puts format("scrape %d (%.1f s): %s; samples by endpoint %s", i + 1, wall,
                    workers.sort.map { |pid, w| "#{pid}=#{w}" }.join(" "), endpoints.sort.to_h)
        sleep [interval - (Process.clock_gettime(Process::CLOCK_MONOTONIC) - tick), 0].max
      end
    when "many"
      count = Integer(ENV.fetch("COUNT", "200"))
      count.times do |i|
        workers, = scrape(listen, 1)
        raise "scrape #{i + 1} missed a process: #{workers}" unless workers.size == 3

        show_footprint("master after #{i + 1} profiles", server.pid) if ((i + 1) % 50).zero?
      end
      count.times do |i|
        response = Net::HTTP.get_response(URI("http://127.0.0.1:#{listen}/debug/pprof/threads"))
        raise "threads: #{response.code}" unless response.code == "200"

        show_footprint("master after #{i + 1} dumps", server.pid) if ((i + 1) % 50).zero?
      end
    else abort "unknown mode #{mode}"
    end
    after = show_footprint("master after", server.pid)
    puts "change: RSS #{after[:rss_kb] - before[:rss_kb]} kB, fds #{after[:fds] - before[:fds]}, " \
         "threads #{after[:threads] - before[:threads]}"
  end
ensure
  stop_servers
end
