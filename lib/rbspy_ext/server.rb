# frozen_string_literal: true

# Loadable alone: Puma's plugin loads this in the master before the app, and so before Rails.
# Loading all of rbspy_ext there would make the workers' own `require "rbspy_ext"` (from
# Bundler.require, after Rails) a no-op, and leave the app without its Railtie.
require_relative "version"
require_relative "error"
require_relative "native"
RubySpy::Native.load!

module RubySpy
  # A pprof listener on a port of its own, as Go's net/http/pprof has: +go tool pprof+,
  # Grafana Alloy and Parca scrape it over plain HTTP, beside the application rather than
  # inside it, so no middleware (+force_ssl+, host authorization, an auth gem) is in the way.
  #
  # It runs on native threads of the extension that never take the GVL, and records this
  # process from outside its VM: it answers while every Ruby thread is busy, or while a C
  # extension holds the GVL in a loop. With +subprocesses: true+ (the default) it records this
  # process and every Ruby process descending from it in one profile, each sample labelled
  # with its +pid+ and, for a preforking server's workers (Puma, Unicorn), its +worker+:
  # a Puma master serves its whole cluster (see +plugin :rubyspy+, lib/puma/plugin/rubyspy.rb).
  #
  # Served (a request brings the token as +?token=+ or +Authorization: Bearer+, or comes from
  # loopback, not through a proxy, when +loopback+ is true):
  # - +GET /debug/pprof/profile?seconds=N[&rate=HZ]+: a gzipped pprof of N seconds (1-60,
  #   default 30) at HZ (1-1000, default 100); one at a time (429 while one runs);
  # - +GET /debug/pprof/threads+: every thread's stack now, as text;
  # - +GET /debug/pprof/+: what is served.
  # A request head must arrive within 5 s and fit in 8 KiB; at most 16 connections are
  # served at once. Forked children (workers) close the listening socket at fork.
  #
  # @example
  #   RubySpy::Server.start(port: 6060)                    # loopback clients only
  #   RubySpy::Server.start(bind: "0.0.0.0", port: 6060, token: ENV.fetch("RUBYSPY_PPROF_TOKEN"))
  class Server
    # The environment variable that starts a listener when rbspy_ext is loaded: "HOST:PORT"
    # or "PORT" (loopback).
    ENV_ADDRESS = "RUBYSPY_PPROF"
    # The token a listener started from the environment requires (optional on loopback).
    ENV_TOKEN = "RUBYSPY_PPROF_TOKEN"
    # Set by a process that serves its subprocesses, so that a Ruby child it starts, which
    # inherits {ENV_ADDRESS}, does not try to take the same port.
    ENV_SERVED_BY = "RUBYSPY_PPROF_SERVED_BY"

    class << self
      # Opens the port and starts serving. One listener per process: a second call while one
      # runs raises.
      #
      # @param bind [String] the address to listen on; anything but loopback needs a token
      # @param port [Integer] 0 lets the system choose (see {#port})
      # @param token [String, nil] the secret clients send; nil serves loopback clients only
      # @param loopback [Boolean] serve loopback clients that bring no token
      # @param subprocesses [Boolean] record this process's Ruby subprocesses too
      # @return [Server]
      # @raise [ListenError] if the port cannot be opened (in use: the message names it)
      # @raise [ArgumentError] for a non-loopback +bind+ without a token, or a bad value
      def start(bind: "127.0.0.1", port: 6060, token: nil, loopback: true, subprocesses: true)
        raise TypeError, "bind must be a String, got #{bind.class}" unless bind.is_a?(String)
        raise TypeError, "port must be an Integer, got #{port.class}" unless port.is_a?(Integer)
        raise ArgumentError, "port must be from 0 to 65535, got #{port}" unless (0..65_535).cover?(port)
        raise TypeError, "token must be a String or nil, got #{token.class}" unless token.nil? || token.is_a?(String)

        LOCK.synchronize do
          raise Error, "a pprof listener already runs in this process, on port #{@current.port}" if @current&.running?

          native = NativeServer.start(bind, port, token, loopback ? true : false, subprocesses ? true : false)
          ENV[ENV_SERVED_BY] = Process.pid.to_s if subprocesses
          @current = new(native, bind)
        end
      end

      # The listener running in this process (nil if none; a forked child has none).
      # @return [Server, nil]
      def current
        @current if @current&.running?
      end

      # Starts a listener from {ENV_ADDRESS} ("127.0.0.1:6060", "6060", "[::1]:6060") and
      # {ENV_TOKEN}, unless one runs already or an ancestor of this process serves it (it
      # records this process as its subprocess). A port that cannot be opened is a warning, not
      # an error: the application boots anyway.
      # @return [Server, nil]
      def start_from_env(env = ENV)
        address = env[ENV_ADDRESS].to_s.strip
        return nil if address.empty? || current || served_by_ancestor?(env[ENV_SERVED_BY])

        bind, port = parse_address(address)
        start(bind: bind, port: port, token: env[ENV_TOKEN])
      rescue Error, ArgumentError => e
        warn "rbspy_ext: #{ENV_ADDRESS}=#{address}: no pprof listener: #{e.message}"
        nil
      end

      # "HOST:PORT", "[V6]:PORT" or "PORT" as [bind, port].
      # @api private
      def parse_address(text)
        host, port = text.match(/\A(?:\[([^\]]+)\]|([^:]+)):(\d+)\z/)&.then { |m| [m[1] || m[2], m[3]] }
        host, port = "127.0.0.1", text if host.nil? && text.match?(/\A\d+\z/)
        raise ArgumentError, "expected HOST:PORT or PORT, got #{text.inspect}" unless host

        [host, Integer(port, 10)]
      end

      private

      def served_by_ancestor?(served_by)
        pid = Integer(served_by.to_s, 10, exception: false)
        return false unless pid && pid != Process.pid

        ancestor = Process.ppid
        8.times do
          return true if ancestor == pid
          break if ancestor <= 1

          ancestor = File.read("/proc/#{ancestor}/stat")[/\) \S+ (\d+)/, 1].to_i
        end
        false
      rescue SystemCallError
        false
      end
    end

    LOCK = Mutex.new
    private_constant :LOCK

    # @api private
    def initialize(native, bind)
      @native = native
      @bind = bind
    end

    # @return [Integer, nil] the port it listens on; nil once stopped
    def port
      @native.port
    end

    # @return [String] the base URL of its endpoints
    def url
      host = @bind.include?(":") ? "[#{@bind}]" : @bind
      "http://#{host}:#{port}/debug/pprof/"
    end

    # False once stopped, and in a forked child (the listener stays the parent's).
    def running?
      @native.running?
    end

    # Closes the port. A profile being recorded finishes for its client. Ruby processes this
    # one starts from now on may serve themselves (see {ENV_SERVED_BY}).
    # @return [nil]
    def stop
      @native.stop
      ENV.delete(ENV_SERVED_BY) if ENV[ENV_SERVED_BY] == Process.pid.to_s
      nil
    end
  end
end
