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

    # Middleware that runs each request inside {RubySpy.tag}: +endpoint+ (the method and
    # route, e.g. "GET /hello/:name" in Sinatra, or the path where no route is known) and
    # +request_id+ (Rails' request id, the +X-Request-Id+ header, or a new random one), plus
    # whatever +extra+ returns. A body the server reads after +call+ returns (streaming) is
    # read under the same tags. The tags end with the request, by exception too, and never
    # cross to another thread or fiber.
    #
    # @example config.ru
    #   use RubySpy::Rack::Tags
    #   use RubySpy::Rack::Tags, extra: ->(env) { {tenant: env["HTTP_X_TENANT"]} }
    class Tags
      # @param app [#call] the Rack application
      # @param endpoint [Boolean] tag +endpoint+ (Rails turns this off here: its controllers
      #   tag "controller#action" themselves)
      # @param extra [#call, nil] called with the Rack env; returns a Hash of more tags
      def initialize(app, endpoint: true, extra: nil)
        raise TypeError, "extra must respond to #call, got #{extra.class}" unless extra.nil? || extra.respond_to?(:call)

        @app = app
        @endpoint = endpoint
        @extra = extra
        Sinatra.install if defined?(::Sinatra::Base)
      end

      # @param env [Hash] the Rack env
      # @return [Array] the Rack response
      def call(env)
        env[TAGGED_KEY] = true
        tags = { request_id: Tags.request_id(env) }
        tags[:endpoint] = "#{env['REQUEST_METHOD']} #{env['SCRIPT_NAME']}#{env['PATH_INFO']}" if @endpoint
        tags.merge!(@extra.call(env)) if @extra
        status, headers, body = RubySpy.tag(**tags) { @app.call(env) }
        tags[:endpoint] = env[ENDPOINT_KEY] if env[ENDPOINT_KEY]
        [status, headers, TaggedBody.wrap(body, tags)]
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
      def self.wrap(body, tags)
        body.respond_to?(:to_ary) ? body : new(body, tags)
      end

      def initialize(body, tags)
        @body = body
        @tags = tags
      end

      def each(&block)
        RubySpy.tag(**@tags) { @body.each(&block) }
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
          RubySpy.tag(endpoint: route) { super }
        end
      end
    end
  end
end

require_relative "rack/pprof"
