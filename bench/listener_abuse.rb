# frozen_string_literal: true

# The native pprof listener under a flood (wrk from Debian; installed here when missing):
#
#   ruby bench/listener_abuse.rb [SECONDS]     (default 10 per run)
#
# A real Ruby process (spec/fixtures/pprof_listener.rb "abuse": its app thread writes a
# count every 10 ms) serves /debug/pprof/ while wrk opens 1,000 connections, then 16 (the
# listener's limit). Prints wrk's requests a second and errors, how often the app thread ticked
# meanwhile against a quiet baseline, whether a scrape made during the flood was answered, and
# the process's threads, descriptors and RSS before and after. spec/listener_abuse_spec.rb
# checks the answers themselves; this measures what a flood costs.
require "json"
require "tmpdir"
require "rbconfig"
require "socket"
require_relative "support"

seconds = Integer(ARGV.fetch(0, "10"))
root = File.expand_path("..", __dir__)

unless system("which wrk", out: File::NULL)
  abort "wrk is missing: apt-get install wrk (needs root)" unless Process.uid.zero?
  system("apt-get", "install", "-y", "-qq", "wrk", out: File::NULL) or abort "apt-get install wrk failed"
end

def holdings(pid)
  format("%d threads, %d fds, %.1f MB", Dir.children("/proc/#{pid}/task").size, Dir.children("/proc/#{pid}/fd").size,
         rss_mb(pid))
end

def ticks(path) = File.read(path).to_i

# Ticks a second of the app thread over +seconds+, while the block runs (if any).
def tick_rate(path, seconds)
  from = ticks(path)
  started = now
  result = block_given? ? yield : sleep(seconds)
  [(ticks(path) - from) / (now - started), result]
end

Dir.mktmpdir("rbspy-abuse-") do |dir|
  ready = File.join(dir, "ready")
  pid = spawn(RbConfig.ruby, File.join(root, "spec/fixtures/pprof_listener.rb"), ready, "abuse",
              err: File.join(dir, "target.log"))
  sleep 0.05 until File.exist?(ready)
  info = JSON.parse(File.read(ready))["info"]
  port = info["port"]
  url = "http://127.0.0.1:#{port}/debug/pprof/"
  before = holdings(pid)
  quiet, = tick_rate(info["ticks"], seconds)
  puts "quiet: app thread #{quiet.round(1)} ticks/s; #{before}"
  [1000, 16].each do |connections|
    scrape = Thread.new do
      sleep 1
      t = now
      begin
        socket = Socket.tcp("127.0.0.1", port, connect_timeout: 10)
        socket.write("GET /debug/pprof/profile?seconds=2&rate=100 HTTP/1.1\r\n\r\n")
        answer = socket.wait_readable(20) ? socket.read.to_s : "no answer within 20 s"
        socket.close
      rescue SystemCallError, IOError => e
        answer = e.class.name
      end
      [answer[/\AHTTP\/1\.1 \d+/] || answer[0, 40].then { |a| a.empty? ? "closed unanswered" : a }, (now - t).round(2)]
    end
    rate, out = tick_rate(info["ticks"], seconds) do
      IO.popen(["wrk", "-t2", "-c#{connections}", "-d#{seconds}s", "--timeout", "5s", url], err: [:child, :out], &:read)
    end
    requests = out[/Requests\/sec:\s+([\d.]+)/, 1]
    errors = out[/Socket errors:.*$/] || "no socket errors"
    non2xx = out[/Non-2xx or 3xx responses: \d+/] || "all 200"
    answer, took = scrape.value
    puts "wrk -c#{connections}: #{requests} requests/s; #{errors}; #{non2xx}; app thread #{rate.round(1)} ticks/s; " \
         "a 2 s profile scrape during it: #{answer} after #{took} s"
  end
  sleep 6 # past the read deadline of any connection wrk left open
  puts "after: #{holdings(pid)}"
  Process.kill(:KILL, pid)
  Process.wait(pid)
end
