# frozen_string_literal: true

require_relative "spec_helper"
require "socket"

# The native pprof listener inside a real Ruby process (spec/fixtures/pprof_listener.rb,
# "abuse"), treated badly on loopback: a thousand clients at once, clients that trickle a byte
# a second, heads that are too large, malformed, not UTF-8, or climb out of /debug/pprof with
# "..", wrong tokens, and a client that hangs up in the middle of a profile. The app's own
# thread must keep running; every request is answered as it should be or closed unanswered,
# never served when it should be refused; and afterwards the process holds the threads and
# descriptors it held before. Bench figures under load (wrk) are in bench/listener_abuse.rb.
RSpec.describe "the pprof listener under abuse" do
  let(:token) { "tok-#{Random.new_seed.to_s(36)}" }

  before do
    skip "no rbspy_ext built for the host Ruby" unless File.exist?(File.join(RubySpyTest::ROOT, "lib", "rbspy_ext", "rbspy_ext.so"))
  end

  # What the listener's process holds: native threads, descriptors, resident memory (KiB).
  def holdings(pid)
    rss = File.read("/proc/#{pid}/status")[/^VmRSS:\s+(\d+)/, 1].to_i
    { threads: Dir.children("/proc/#{pid}/task").size, fds: Dir.children("/proc/#{pid}/fd").size, rss_kb: rss }
  end

  # Sends +bytes+ and reads until the listener closes: its whole answer, or "" when it closed
  # the connection unanswered.
  def exchange(port, bytes, timeout: 30)
    socket = Socket.tcp("127.0.0.1", port, connect_timeout: timeout)
    socket.write(bytes)
    read_all(socket, timeout)
  ensure
    socket&.close
  end

  def read_all(socket, timeout)
    out = +""
    deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + timeout
    loop do
      left = deadline - Process.clock_gettime(Process::CLOCK_MONOTONIC)
      raise "no end of answer within #{timeout} s: #{out[0, 200].inspect}" if left <= 0

      next unless socket.wait_readable(left)

      chunk = socket.read_nonblock(65_536, exception: false)
      return out if chunk.nil?
      next if chunk == :wait_readable

      out << chunk
    end
  rescue Errno::ECONNRESET
    out
  end

  def status(answer) = answer[/\AHTTP\/1\.1 (\d{3})/, 1]&.to_i

  def ticks(target) = File.read(target.info["ticks"]).to_i

  it "answers each request as it should, keeps the app running, and holds no more afterwards" do
    target = start_target("pprof_listener", "abuse", env: { "LISTENER_TOKEN" => token })
    port = target.info["port"]
    get = ->(path, headers = "") { "GET #{path} HTTP/1.1\r\nHost: 127.0.0.1\r\n#{headers}\r\n" }
    # Every route once, so that what a listener makes on first use is there in the baseline.
    expect(status(exchange(port, get.("/debug/pprof/")))).to eq(200)
    expect(status(exchange(port, get.("/debug/pprof/threads")))).to eq(200)
    before = wait_for("the listener idle") { (h = holdings(target.pid)) && h[:threads] <= 4 && h }
    ticks_before = ticks(target)

    # Refused, each with its status: never served.
    refusals = {
      get.("/debug/pprof/../debug/pprof/threads") => 404,
      get.("/debug/pprof/threads/..") => 404,
      get.("/debug/pprof/%2e%2e/threads") => 404,
      get.("/etc/passwd") => 404,
      "GET /debug/pprof/\xff\xfe HTTP/1.1\r\n\r\n".b => 400,
      get.("/debug/pprof/profile?seconds=%ff%fe") => 400,
      get.("/debug/pprof/profile?seconds=0") => 400,
      get.("/debug/pprof/profile?seconds=1&seconds=2") => 400,
      get.("/debug/pprof/?#{"a" * 20_000}") => 431,
      get.("/debug/pprof/", (1..40).map { |i| "X-Pad-#{i}: #{i}\r\n" }.join) => 431,
      "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n".b => 400,
      "POST /debug/pprof/threads HTTP/1.1\r\nContent-Length: 0\r\n\r\n" => 405,
      get.("/debug/pprof/threads?token=wrong-#{token}") => 403,
      get.("/debug/pprof/threads", "Authorization: Bearer wrong-#{token}\r\n") => 403,
      get.("/debug/pprof/threads", "X-Forwarded-For: 203.0.113.9\r\n") => 403,
    }
    answered = refusals.transform_values.with_index { |_, i| status(exchange(port, refusals.keys[i])) }
    expect(answered).to eq(refusals)
    # The token, as a parameter or a bearer, is taken even through a proxy.
    expect(status(exchange(port, get.("/debug/pprof/threads?token=#{token}", "X-Forwarded-For: 203.0.113.9\r\n")))).to eq(200)
    expect(status(exchange(port, get.("/debug/pprof/", "Authorization: Bearer #{token}\r\n")))).to eq(200)

    # A thousand clients at once: each is served or closed unanswered, none left hanging.
    limit = Process.getrlimit(:NOFILE)
    Process.setrlimit(:NOFILE, [limit[1], 2048].min, limit[1])
    sockets = Array.new(1000) { Socket.tcp("127.0.0.1", port, connect_timeout: 30) }
    sockets.each { |s| s.write(get.("/debug/pprof/")) }
    statuses = sockets.map { |s| status(read_all(s, 30)) }.tally
    sockets.each(&:close)
    expect(statuses.keys - [200, nil]).to eq([]), statuses.inspect
    expect(statuses[200].to_i).to be >= 1, statuses.inspect

    # Sixteen clients that send a byte a second hold every connection slot. Each is cut off
    # at the read deadline (408), or closed unanswered when a new client takes its place
    # after it has sent for a second; one is served meanwhile.
    slow = Array.new(16) { Socket.tcp("127.0.0.1", port) }
    trickle = Thread.new do
      request = get.("/debug/pprof/")
      request.each_char.with_index do |c, i|
        break if i >= 8

        slow.each { |s| s.write(c) rescue nil } # rubocop:disable Style/RescueModifier
        sleep 1
      end
    end
    sleep 1.5
    meanwhile = Array.new(10) { status(exchange(port, get.("/debug/pprof/"))) }
    slow_statuses = slow.map { |s| status(read_all(s, 30)) }
    trickle.kill
    slow.each(&:close)
    expect(meanwhile.compact.first).to eq(200), meanwhile.inspect
    expect(slow_statuses - [408, nil]).to eq([]), slow_statuses.inspect
    expect(slow_statuses).to include(nil)

    # A client that hangs up a moment into a two-second profile: the profile runs to its end,
    # and the next is served (not refused as busy for good).
    hangup = Socket.tcp("127.0.0.1", port)
    hangup.write(get.("/debug/pprof/profile?seconds=2&rate=50"))
    sleep 0.3
    hangup.close
    served = wait_for("a profile served after a client hung up", timeout: 30, interval: 0.5) do
      answer = exchange(port, get.("/debug/pprof/profile?seconds=1&rate=50"))
      status(answer) == 200 && answer
    end
    expect(served).to include("application/octet-stream").or include("content-type")

    # The app's own thread ran all along.
    expect(ticks(target)).to be > ticks_before
    # What the listener held for all this it gives back: its threads end, its sockets close.
    settled = wait_for("the listener's threads and sockets given back", timeout: 15, interval: 0.1) do
      h = holdings(target.pid)
      h[:threads] <= before[:threads] && h[:fds] <= before[:fds] && h
    end
    expect(settled[:threads]).to be <= before[:threads]
    expect(settled[:fds]).to be <= before[:fds]
    # Memory: freed thread stacks go back; malloc keeps a little. Bounded, not exact.
    expect(settled[:rss_kb] - before[:rss_kb]).to be < 8 * 1024, "#{before} -> #{settled}"
    warn "listener abuse: #{before} -> #{settled}; 1,000 clients at once: #{statuses}" if ENV["RUBYSPY_VERBOSE"]

    # The token appears nowhere the process writes.
    expect(File.read(target.log_path)).not_to include(token)
    expect(target.health_problems).to eq([])
  end
end
