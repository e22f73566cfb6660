# frozen_string_literal: true

require "rack"

module RubySpy
  # Rack pieces: {Rack::Tags} tags every request's samples, {Rack::Pprof} serves profiles of the
  # serving process the way Go's net/http/pprof does, for fleet profilers to scrape.
  module Rack
    # Where a framework that knows the request's route puts it (see {Tags}).
    ENDPOINT_KEY = "rubyspy.endpoint"
    # Set while {Tags} handles the request.
    TAGGED_KEY = "rubyspy.tagged"
    # The request's trace from its +traceparent+ header, as {RubySpy.trace}'s arguments.
    TRACE_KEY = "rubyspy.trace"

    # Middleware that runs each request inside {RubySpy.tag}: +endpoint+ (the method and
    # route, e.g. "GET /hello/:name" in Sinatra, or the path where no route is known) and
    # +request_id+ (Rails' request id, the +X-Request-Id+ header, or a new random one), plus
    # whatever +extra+ returns. A body the server reads after +call+ returns (streaming) is
    # read under the same tags. The tags end with the request, by exception too, and never
    # cross to another thread or fiber.
    #
    # Where no tracer runs in the app (the OpenTelemetry bridge, {OTel}, is not installed), a
    # request with a valid W3C +traceparent+ header runs under its trace ({RubySpy.trace}):
    # its samples carry the caller's trace id, and its parent span's id as the span and the
    # local root span (the one span of this request that a backend has), with the route
    # (Sinatra's, once matched) or the path as the endpoint.
    #
    # @example config.ru
    #   use RubySpy::Rack::Tags
    #   use RubySpy::Rack::Tags, extra: ->(env) { {tenant: env["HTTP_X_TENANT"]} }
    class Tags
      # @param app [#call] the Rack application
      # @param endpoint [Boolean] tag +endpoint+ (Rails turns this off here: its controllers
      #   tag "controller#action" themselves)
      # @param extra [#call, nil] called with the Rack env; returns a Hash of more tags
      # @param traceparent [Boolean] take the trace of a request's +traceparent+ header
      #   where no tracer in the app does
      def initialize(app, endpoint: true, extra: nil, traceparent: true)
        raise TypeError, "extra must respond to #call, got #{extra.class}" unless extra.nil? || extra.respond_to?(:call)

        @app = app
        @endpoint = endpoint
        @extra = extra
        @traceparent = traceparent
        Sinatra.install if defined?(::Sinatra::Base)
      end

      # @param env [Hash] the Rack env
      # @return [Array] the Rack response
      def call(env)
        env[TAGGED_KEY] = true
        path = "#{env['REQUEST_METHOD']} #{env['SCRIPT_NAME']}#{env['PATH_INFO']}"
        tags = { request_id: Tags.request_id(env) }
        tags[:endpoint] = path if @endpoint
        tags.merge!(@extra.call(env)) if @extra
        Tags.take_trace(env, path) if @traceparent
        status, headers, body = Tags.traced(env) { RubySpy.tag(**tags) { @app.call(env) } }
        tags[:endpoint] = env[ENDPOINT_KEY] if env[ENDPOINT_KEY]
        [status, headers, TaggedBody.wrap(body, tags, env[TRACE_KEY])]
      end

      # Puts the trace of +env+'s +traceparent+ header in +env[TRACE_KEY]+, named +endpoint+,
      # unless the header is missing or invalid, or a tracer in the app takes it.
      # @api private
      def self.take_trace(env, endpoint)
        return if RubySpy::OTel.installed?

        parent = RubySpy::TraceIds.traceparent(env["HTTP_TRACEPARENT"])
        return unless parent

        env[TRACE_KEY] = { trace_id: parent[:trace_id], span_id: parent[:span_id],
                           local_root_span_id: parent[:span_id], endpoint: endpoint, sampled: parent[:sampled] }
      end

      # Runs the block under +env[TRACE_KEY]+'s trace, or as it is where there is none.
      # @api private
      def self.traced(env, &block)
        trace = env[TRACE_KEY]
        trace ? RubySpy.trace(**trace, &block) : yield
      end

      # The request's id: the one Rails' RequestId middleware chose, the client's
      # +X-Request-Id+, or a new one.
      # @param env [Hash]
      # @return [String]
      def self.request_id(env)
        env["action_dispatch.request_id"] || env["HTTP_X_REQUEST_ID"] || Random.bytes(8).unpack1("H*")
      end
    end

    # A response body read under the request's tags: servers call +each+ after the app has
    # returned, so a streamed body would otherwise run untagged. Bodies that are already
    # arrays are returned as they are.
    # @api private
    class TaggedBody
      def self.wrap(body, tags, trace)
        body.respond_to?(:to_ary) ? body : new(body, tags, trace)
      end

      def initialize(body, tags, trace)
        @body = body
        @tags = tags
        @trace = trace
      end

      def each(&block)
        read = -> { RubySpy.tag(**@tags) { @body.each(&block) } }
        @trace ? RubySpy.trace(**@trace, &read) : read.call
      end

      def close
        @body.close if @body.respond_to?(:close)
      end

      def respond_to_missing?(name, include_private = false)
        @body.respond_to?(name, include_private)
      end

      # Forwards what servers probe bodies for (+to_path+ for sendfile, +call+ for Rack 3
      # streaming) to the wrapped body.
      def method_missing(name, ...)
        @body.respond_to?(name) ? @body.public_send(name, ...) : super
      end
    end

    # Tags a Sinatra route's handler with the route ("GET /hello/:name"), which Sinatra knows
    # only once it has matched, inside the request {Tags} tagged. Installed by {Tags}.
    # @api private
    module Sinatra
      def self.install
        return if ::Sinatra::Base < RouteEval

        ::Sinatra::Base.prepend(RouteEval)
      end

      # Sinatra runs each matched route's block through +route_eval+ with
      # +env["sinatra.route"]+ set.
      module RouteEval
        private

        def route_eval
          route = env["sinatra.route"]
          return super unless route && env[TAGGED_KEY]

          env[ENDPOINT_KEY] = route
          env[TRACE_KEY] = env[TRACE_KEY].merge(endpoint: route) if env[TRACE_KEY]
          Tags.traced(env) { RubySpy.tag(endpoint: route) { super } }
        end
      end
    end
  end
end

require_relative "rack/pprof"
