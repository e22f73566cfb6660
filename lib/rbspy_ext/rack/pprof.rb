# frozen_string_literal: true

require "rack"

module RubySpy
  module Rack
    # A Rack application that profiles the process serving it, the way Go's net/http/pprof
    # does: +GET /profile?seconds=N+ records every thread of this process for N seconds
    # (sampling on a native thread, off the GVL) and returns a gzipped pprof profile, so
    # +go tool pprof+, Grafana Alloy's +pyroscope.scrape+ and Parca can fetch it. Tags
    # ({RubySpy.tag}, {Tags}, the Rails integration) become pprof labels, as do each sample's
    # thread name and state (+thread+, +state+). +GET /+ lists what is served.
    #
    # Safe defaults, since it may be reachable from the internet:
    # - a request is served only when its token matches (+?token=+ or
    #   +Authorization: Bearer+), or, when it brings none, when it comes from a loopback
    #   address and not through a proxy (no +X-Forwarded-For+ or +Forwarded+ header); else 403;
    # - one profile at a time per process (429 while one runs);
    # - +seconds+ is a whole number from 1 to 60 (30 when absent) and +rate+ from 1 to 1000 Hz
    #   (100 when absent), +state_leaves+ 0 or 1 (1: waits for the GVL and GC pauses end in
    #   leaves of their own, +[waiting for GVL]+...); anything else, or any other parameter,
    #   is a 400.
    # In Puma's cluster mode each worker is its own process and serves its own profile.
    #
    # @example config/routes.rb
    #   mount RubySpy::Rack::Pprof.new(token: ENV["RUBYSPY_TOKEN"]), at: "/debug/pprof"
    class Pprof
      # Longest profile one request may ask for, in seconds.
      MAX_SECONDS = 60
      # Highest sampling rate one request may ask for, in Hz.
      MAX_RATE = 1000
      DEFAULT_SECONDS = 30
      DEFAULT_RATE = 100
      PARAMETERS = %w[seconds rate state_leaves token].freeze

      # @param token [String, nil] the secret a non-loopback client must send; nil serves
      #   loopback clients only
      # @param loopback [Boolean] serve loopback clients without a token
      def initialize(token: nil, loopback: true)
        raise TypeError, "token must be a String or nil, got #{token.class}" unless token.nil? || token.is_a?(String)
        raise ArgumentError, "token must not be empty: pass nil to serve loopback clients only" if token&.empty?

        @token = token
        @loopback = loopback
      end

      # @param env [Hash] the Rack env
      # @return [Array] the Rack response
      def call(env)
        return reply(405, "only GET is served\n") unless %w[GET HEAD].include?(env["REQUEST_METHOD"])

        case env["PATH_INFO"]
        when "", "/" then index(env)
        when "/profile" then profile(env)
        when "/allocs" then memory(env, :allocs)
        when "/heap" then memory(env, :heap)
        else reply(404, "not found: try #{env['SCRIPT_NAME']}/\n")
        end
      end

      private

      def index(env)
        base = env["SCRIPT_NAME"]
        reply(200, <<~TEXT)
          rbspy_ext profiles of process #{Process.pid} (Ruby #{RUBY_VERSION})

          #{base}/allocs[?gc=1]
              While allocations are tracked (RubySpy.track_allocations, RUBYSPY_ALLOCATIONS=1):
              every sampled allocation by the stack that made it, as a gzipped pprof profile
              opening on alloc_space (alloc_objects, inuse_space and inuse_objects too).
              gc=1 runs a full GC first.

          #{base}/heap[?gc=1][&census=1]
              While allocations are tracked: the sampled objects still alive, by stack
              (opening on inuse_space). Otherwise, or with census=1: a census of this
              process's heap by class (inuse_objects, inuse_space).

          #{base}/profile?seconds=N[&rate=HZ][&state_leaves=0]
              Records every thread of this process for N seconds (1-#{MAX_SECONDS}, default #{DEFAULT_SECONDS})
              at HZ samples a second (1-#{MAX_RATE}, default #{DEFAULT_RATE}) and returns a gzipped
              pprof profile: wall time by stack, labelled with each sample's thread, state
              and RubySpy tags. Fetch it with: go tool pprof URL
              Waits for the GVL and GC pauses end in leaves of their own ([waiting for GVL],
              [GC marking]...); state_leaves=0 bills them to the frame they stood in.
        TEXT
      end

      # /allocs: the tracked allocations (404 while tracking is off); /heap: the tracked
      # objects still alive, or, while tracking is off or with census=1, a census of this
      # process's heap by class. gc=1 runs a full GC first.
      def memory(env, path)
        params = ::Rack::Utils.parse_query(env["QUERY_STRING"].to_s)
        return reply(403, "forbidden: send the token (?token= or Authorization: Bearer)\n") unless allowed?(env, params)

        known = path == :heap ? %w[gc census token] : %w[gc token]
        unknown = params.keys - known
        return reply(400, "unknown parameter #{unknown.join(', ')}: only #{known.join(', ')}\n") if unknown.any?

        gc, census = %w[gc census].map { |key| whole(params.fetch(key, "0"), 0..1) }
        return reply(400, "gc must be 0 or 1\n") unless gc
        return reply(400, "census must be 0 or 1\n") unless census

        body = Pprof.exclusively { memory_profile(path, gc == 1, census == 1) }
        return reply(429, "a profile or census is already being taken in this process; try again later\n", "retry-after" => "1") unless body
        return reply(404, "allocation tracking is off in this process: start it with RubySpy.track_allocations, or RUBYSPY_ALLOCATIONS=1 in its environment\n") if body == :off

        file(body, path)
      end

      def memory_profile(path, gc, census)
        tracking = NativeAllocations.tracking?
        return RubySpy.heap(Process.pid).render(:pprof) if path == :heap && (census || !tracking)
        return :off unless tracking

        RubySpy.allocations(gc: gc).pprof(opens: path)
      end

      def file(body, name)
        [200, { "content-type" => "application/octet-stream",
                "content-disposition" => %(attachment; filename="#{name}.pb.gz"),
                "content-length" => body.bytesize.to_s }, [body]]
      end

      def profile(env)
        params = ::Rack::Utils.parse_query(env["QUERY_STRING"].to_s)
        return reply(403, "forbidden: send the token (?token= or Authorization: Bearer)\n") unless allowed?(env, params)

        unknown = params.keys - PARAMETERS
        return reply(400, "unknown parameter #{unknown.join(', ')}: only #{PARAMETERS.join(', ')}\n") if unknown.any?

        seconds = whole(params.fetch("seconds", DEFAULT_SECONDS.to_s), 1..MAX_SECONDS)
        return reply(400, "seconds must be a whole number from 1 to #{MAX_SECONDS}\n") unless seconds

        rate = whole(params.fetch("rate", DEFAULT_RATE.to_s), 1..MAX_RATE)
        return reply(400, "rate must be a whole number of Hz from 1 to #{MAX_RATE}\n") unless rate

        leaves = whole(params.fetch("state_leaves", "1"), 0..1)
        return reply(400, "state_leaves must be 0 or 1\n") unless leaves

        Pprof.exclusively { record(seconds, rate, state_leaves: leaves == 1) } ||
          reply(429, "a profile is already being recorded in this process; try again later\n",
                "retry-after" => seconds.to_s)
      end

      def record(seconds, rate, state_leaves:)
        recorder = Recorder.new(Process.pid, rate: rate, duration: seconds).start
        # Sleeping releases the GVL; the recorder stops itself at the duration.
        deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + seconds + 0.5
        sleep 0.05 while recorder.running? && Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
        file(recorder.stop.render(:pprof, state_leaves: state_leaves), :profile)
      rescue UnsupportedPlatform => e
        reply(501, "#{e.message}\n")
      end

      def allowed?(env, params)
        given = params["token"] || env["HTTP_AUTHORIZATION"].to_s[/\ABearer (.+)\z/, 1]
        return !@token.nil? && ::Rack::Utils.secure_compare(given, @token) if given

        @loopback && Pprof.loopback?(env)
      end

      def whole(text, range)
        return nil unless text.is_a?(String) && text.match?(/\A\d{1,6}\z/)

        value = Integer(text, 10)
        range.cover?(value) ? value : nil
      end

      def reply(status, text, headers = {})
        [status, { "content-type" => "text/plain; charset=utf-8",
                   "content-length" => text.bytesize.to_s }.merge(headers), [text]]
      end

      LOCK = Mutex.new
      private_constant :LOCK
      @busy = nil

      class << self
        # Runs the block unless another profile is being recorded in this process.
        # @api private
        # @return the block's value, or nil when busy
        def exclusively
          LOCK.synchronize do
            # A fork copies the flag of a recording that stays in the parent.
            return nil if @busy == Process.pid

            @busy = Process.pid
          end
          begin
            yield
          ensure
            LOCK.synchronize { @busy = nil }
          end
        end

        # The peer is this machine and no proxy forwarded the request.
        # @api private
        def loopback?(env)
          return false if env["HTTP_X_FORWARDED_FOR"] || env["HTTP_FORWARDED"]

          addr = env["REMOTE_ADDR"].to_s
          addr == "::1" || addr.match?(/\A(::ffff:)?127\.\d+\.\d+\.\d+\z/)
        end
      end
    end
  end
end
