# frozen_string_literal: true

require "rails/railtie"
require_relative "rack"

module RubySpy
  # Loaded by +require "rbspy_ext"+ when Rails is present. Tags, with no code in the app:
  # - every request: +request_id+ (Rails' own id) from the middleware on, and +endpoint+,
  #   "controller#action" (e.g. "orders#show"), around each action, including its callbacks,
  #   rendering, exceptions, and streamed bodies;
  # - every ActiveJob perform: +job+ (the class) and +job_id+.
  #
  # @example config/application.rb
  #   config.rubyspy.tags = false                                   # no tags at all
  #   config.rubyspy.extra_tags = ->(request) { {tenant: request.subdomain} }
  class Railtie < ::Rails::Railtie
    config.rubyspy = ActiveSupport::OrderedOptions.new
    config.rubyspy.tags = true
    config.rubyspy.extra_tags = nil

    # The OpenTelemetry SDK is configured in an initializer, usually: from then on, every
    # request's trace is published for readers outside (RubySpy::OTel).
    initializer "rbspy_ext.otel", after: :load_config_initializers do
      RubySpy::OTel.install if defined?(::OpenTelemetry::Context)
    end

    initializer "rbspy_ext.tags" do |app|
      options = app.config.rubyspy
      next unless options.tags

      extra = options.extra_tags
      raise TypeError, "config.rubyspy.extra_tags must respond to #call" unless extra.nil? || extra.respond_to?(:call)

      # After RequestId, so the request id is Rails' own.
      app.middleware.insert_after ActionDispatch::RequestId, RubySpy::Railtie::RequestTags, endpoint: false
      RubySpy::Railtie.extra_tags = extra
      RubySpy::Railtie.enabled = true
      # Prepended rather than installed as around_action/around_perform callbacks: one
      # around callback takes Rails' callback chains off their fast path, which costs some
      # 7 us a request (bench/rails.rb), far more than the tags themselves.
      ActiveSupport.on_load(:action_controller) { prepend RubySpy::Railtie::ActionTags }
      ActiveSupport.on_load(:active_job) { prepend RubySpy::Railtie::JobTags }
    end

    class << self
      # The app's +config.rubyspy.extra_tags+ (nil for none).
      # @api private
      attr_accessor :extra_tags

      # Whether the Railtie tags requests and jobs now: true from boot when
      # +config.rubyspy.tags+ is on. Set it to false at run time (a console, a feature flag)
      # to stop tagging without a restart; the Railtie's hooks then only check this flag.
      # It cannot turn on tags that +config.rubyspy.tags = false+ kept from being installed.
      # @return [Boolean]
      attr_accessor :enabled
    end
    self.enabled = false

    # Most distinct "controller#action" strings kept: routes name a bounded set, but a
    # catch-all +:action+ segment would let clients name new ones.
    ENDPOINTS_KEPT = 10_000
    @endpoints = {}

    # The frozen "controller#action" string of an action, built once per action.
    # @api private
    def self.endpoint(controller_path, action_name)
      by_action = @endpoints[controller_path] ||= {}
      by_action[action_name] || begin
        endpoint = "#{controller_path}##{action_name}".freeze
        by_action[action_name] = endpoint if @endpoints.sum { |_, h| h.size } < ENDPOINTS_KEPT
        endpoint
      end
    end

    # Runs each action, with its callbacks, rendering and rescue handlers, under +endpoint+,
    # +request_id+ and the extra tags, and leaves the endpoint for the body's tags.
    # @api private
    module ActionTags
      def process_action(*)
        return super unless RubySpy::Railtie.enabled

        endpoint = RubySpy::Railtie.endpoint(controller_path, action_name)
        env = request.env
        env[RubySpy::Rack::ENDPOINT_KEY] = endpoint
        extra = RubySpy::Railtie.extra_tags
        if extra
          RubySpy.tag(endpoint: endpoint, request_id: request.request_id, **extra.call(request)) { super }
        else
          RubySpy.tag(endpoint: endpoint, request_id: request.request_id) { super }
        end
      end
    end

    # {RubySpy::Rack::Tags} that steps aside while {Railtie.enabled} is false.
    # @api private
    class RequestTags < RubySpy::Rack::Tags
      def call(env)
        RubySpy::Railtie.enabled ? super : @app.call(env)
      end
    end

    # Runs each ActiveJob perform, with its callbacks, under +job+ (the class) and +job_id+.
    # @api private
    module JobTags
      def perform_now
        return super unless RubySpy::Railtie.enabled

        RubySpy.tag(job: self.class.name, job_id: job_id) { super }
      end
    end
  end
end
