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

    initializer "rbspy_ext.tags" do |app|
      options = app.config.rubyspy
      next unless options.tags

      extra = options.extra_tags
      raise TypeError, "config.rubyspy.extra_tags must respond to #call" unless extra.nil? || extra.respond_to?(:call)

      # After RequestId, so the request id is Rails' own.
      app.middleware.insert_after ActionDispatch::RequestId, RubySpy::Rack::Tags, endpoint: false
      ActiveSupport.on_load(:action_controller) do
        around_action { |controller, action| RubySpy::Railtie.tag_action(controller, extra, &action) }
      end
      ActiveSupport.on_load(:active_job) do
        around_perform { |job, perform| RubySpy.tag(job: job.class.name, job_id: job.job_id, &perform) }
      end
    end

    # Runs an action under its tags, and leaves its endpoint for the body's tags.
    # @api private
    def self.tag_action(controller, extra)
      request = controller.request
      endpoint = "#{controller.controller_path}##{controller.action_name}"
      request.env[RubySpy::Rack::ENDPOINT_KEY] = endpoint
      tags = { endpoint: endpoint, request_id: request.request_id }
      tags.merge!(extra.call(request)) if extra
      RubySpy.tag(**tags) { yield }
    end
  end
end
