# frozen_string_literal: true

module RubySpy
  # OpenTelemetry's context for readers outside the process (OTEP 4719 and 4947), written by
  # the extension (ext/rbspy_ext/src/otel.rs) from what the OpenTelemetry SDK does:
  # - when the SDK attaches or detaches a context (+OpenTelemetry::Context.attach+,
  #   +detach+, and so +in_span+, +with_span+ and every instrumentation), the current fiber's
  #   record names the span now current, its trace, the trace's first span in this process
  #   (the local root: the request's) and that span's name, and carries the fiber's tags;
  # - the process context (the +OTEL_CTX+ mapping) carries the SDK's resource attributes and
  #   the names of the record's attributes, and is published again after
  #   +OpenTelemetry::SDK.configure+ and in a forked child.
  #
  # It installs itself when +rbspy_ext+ is required after the OpenTelemetry API, and from the
  # Railtie in a Rails app; {install} does it by hand. Readers: +RubySpy.snapshot(pid,
  # threads: :all)+, {Handle#thread_snapshots} and the profilers give each thread's and
  # sample's trace among its tags; docs/otel-context.md says what another reader finds.
  module OTel
    # RUBYSPY_OTEL=0 in the environment keeps the bridge off: no record, no process context.
    ENV_SWITCH = "RUBYSPY_OTEL"
    # Most traces whose local root is remembered at once (one entry per trace in flight).
    ROOTS_KEPT = 4096
    # The semantic conventions' attributes that name the code a span runs.
    CODE_NAMESPACE = "code.namespace"
    CODE_FUNCTION = "code.function"
    # Attributes whose change renames a request's endpoint.
    ENDPOINT_ATTRIBUTES = [CODE_NAMESPACE, CODE_FUNCTION].freeze

    # The fiber-local holding, for each context this bridge saw attached in the fiber, the
    # state that was current before it (what the matching detach puts back).
    STACK_KEY = :__rubyspy_otel_states__

    @installed = false
    @roots = {}
    @endpoints = {}.compare_by_identity

    class << self
      # In a forked child: its own process context (the parent's mapping is not inherited).
      # @api private
      def forked
        NativeOTel.after_fork
        @published &&= Process.pid
      end

      # Hooks the OpenTelemetry API (and the SDK, when loaded) and publishes the process
      # context. Does nothing without the API, with RUBYSPY_OTEL=0, or when done already.
      # @return [Boolean] whether the bridge is on
      def install
        return true if @installed
        return false if ENV[ENV_SWITCH] == "0"
        return false unless defined?(::OpenTelemetry::Context) && defined?(NativeOTel)

        ::OpenTelemetry::Context.singleton_class.prepend(ContextHook)
        hook_sdk
        hook_fork
        @installed = true
        publish_process
        context_changed(::OpenTelemetry::Context.current)
        true
      end

      # Whether {install} has run.
      # @return [Boolean]
      def installed?
        @installed
      end

      # Publishes the process context with the SDK's resource attributes now.
      # @api private
      def publish_process
        @published = Process.pid
        NativeOTel.publish_process(resource_attributes)
      end

      # Publishes the process context unless it is out already, for a writer other than the
      # SDK ({RubySpy.trace}): a forked child publishes its own too. With RUBYSPY_OTEL=0,
      # nothing. With the SDK, its resource; without, +service.name+ from OTEL_SERVICE_NAME,
      # as the SDK would name it.
      # @return [Boolean] whether the process context is published
      # @api private
      def publish_once
        return true if @published == Process.pid
        return false if ENV[ENV_SWITCH] == "0"

        if @published
          # A forked child the fork hook did not see (Ruby before 3.1 has no Process._fork):
          # its own process context, now.
          forked
        else
          hook_fork
          publish_process
        end
        true
      end

      # +context+ was attached in this fiber, +previous+ (a State or nil) being the state
      # before it: kept for the matching detach, then the record made for +context+.
      # @api private
      def attached(context, previous)
        (Thread.current[STACK_KEY] ||= []) << previous
        context_changed(context)
      end

      # A context was detached, leaving +context+ current: the state from before its attach
      # comes back as it was (no new record: a detach costs what a fiber switch does), but
      # for its endpoint: one made before its request was routed comes back with the
      # endpoint of now (+State.apply+ and RubySpy.tag's restore check, in the extension). A
      # detach this bridge saw no attach for (installed mid-request) makes a record instead.
      # @api private
      def detached(context)
        stack = Thread.current[STACK_KEY]
        if stack.nil? || stack.empty?
          context_changed(context)
        else
          State.apply(stack.pop)
        end
      end

      # The context stack was emptied (+OpenTelemetry::Context.clear+).
      # @api private
      def cleared
        Thread.current[STACK_KEY] = nil
        context_changed(::OpenTelemetry::Context.current)
      end

      # Makes the current fiber's record say what +context+ (the SDK's current context) says.
      # @api private
      def context_changed(context)
        span = ::OpenTelemetry::Trace.current_span(context)
        sc = span.context
        unless sc.valid?
          NativeOTel.trace(nil, nil, 0, nil, nil)
          return
        end
        root = local_root(span, sc.trace_id)
        endpoint = @endpoints.fetch(root) { @endpoints[root] = endpoint(root) }
        NativeOTel.trace(sc.trace_id, sc.span_id, sc.trace_flags.sampled? ? 1 : 0, root.context.span_id, endpoint)
      end

      # What the request of +root+ (a local root span) does: the controller action as
      # "Class#method" where the instrumentation says (ActionPack's code.namespace and
      # code.function, whatever its span naming), else the span's name (the Rack
      # instrumentation's "GET /orders/:id" once routed, "GET" before). Nil for a span that
      # is not recording (an unsampled trace: no name, no attributes).
      def endpoint(root)
        return nil unless root.respond_to?(:name)

        # The SDK's span keeps them in @attributes; its #attributes copies the Hash, which
        # took 900 ns here, as much as the rest of a record, once per request.
        attributes = root.instance_variable_get(:@attributes) if root.instance_variable_defined?(:@attributes)
        attributes = root.attributes if !attributes.is_a?(Hash) && root.respond_to?(:attributes)
        attributes = nil unless attributes.is_a?(Hash)
        namespace = attributes && attributes[CODE_NAMESPACE]
        function = attributes && attributes[CODE_FUNCTION]
        return "#{namespace}##{function}" if namespace && function

        root.name&.to_s
      end

      # A span was renamed (Rails' instrumentation names the request's span once routed):
      # the current record follows when it is the current trace's local root.
      # @api private
      def renamed(span)
        return unless @roots[span.context.trace_id].equal?(span)

        @endpoints[span] = endpoint(span)
        current = ::OpenTelemetry::Context.current
        context_changed(current) if ::OpenTelemetry::Trace.current_span(current).context.trace_id == span.context.trace_id
      end

      # A span is ending: the fiber it is current in stops naming it now. The SDK takes the
      # span's end time first, then hands it to its processors inside +finish+ (a
      # SimpleSpanProcessor exports it there, and may wait on its exporter), and only then
      # is the context detached: samples of that work are not in the span.
      # @api private
      def finishing(span)
        NativeOTel.trace(nil, nil, 0, nil, nil) if ::OpenTelemetry::Trace.current_span.equal?(span)
      end

      # A span ended: a local root is forgotten.
      # @api private
      def finished(span)
        id = span.context.trace_id
        return unless @roots[id].equal?(span)

        @roots.delete(id)
        @endpoints.delete(span)
      end

      private

      # The first span of +trace_id+ seen current in this process, while it runs.
      def local_root(span, trace_id)
        root = @roots[trace_id]
        return root if root

        if @roots.size >= ROOTS_KEPT
          @roots.clear
          @endpoints.clear
        end
        @roots[trace_id] = span
      end

      def hook_sdk
        return unless defined?(::OpenTelemetry::SDK::Trace::Span)

        ::OpenTelemetry::SDK::Trace::Span.prepend(SpanHook)
        ::OpenTelemetry::SDK.singleton_class.prepend(ConfigureHook)
      end

      def hook_fork
        return if @fork_hooked || !::Process.respond_to?(:_fork)

        ::Process.singleton_class.prepend(ForkHook)
        @fork_hooked = true
      end

      # The SDK's resource attributes as [key, value] Strings (none before it is configured);
      # without the SDK, the service's name as the SDK's default resource gives it.
      def resource_attributes
        unless defined?(::OpenTelemetry.tracer_provider)
          return [["service.name", ENV.fetch("OTEL_SERVICE_NAME", "unknown_service:ruby")]]
        end

        provider = ::OpenTelemetry.tracer_provider
        resource = provider.instance_variable_get(:@resource) if provider
        return [] unless resource.respond_to?(:attribute_enumerator)

        resource.attribute_enumerator.map { |k, v| [k.to_s, v.is_a?(Array) ? v.join(", ") : v.to_s] }
      end
    end

    # Prepended to +OpenTelemetry::Context+'s singleton class.
    # @api private
    module ContextHook
      def attach(context)
        previous = RubySpy::State.current
        token = super
        RubySpy::OTel.attached(context, previous)
        token
      end

      def detach(token)
        matched = super
        RubySpy::OTel.detached(current)
        matched
      end

      def clear
        super
        RubySpy::OTel.cleared
      end
    end

    # Prepended to the SDK's span.
    # @api private
    module SpanHook
      def name=(new_name)
        super
        RubySpy::OTel.renamed(self)
      end

      def set_attribute(key, value)
        result = super
        RubySpy::OTel.renamed(self) if ENDPOINT_ATTRIBUTES.include?(key)
        result
      end

      def add_attributes(attributes)
        result = super
        RubySpy::OTel.renamed(self) if attributes.keys.intersect?(ENDPOINT_ATTRIBUTES)
        result
      end

      def finish(end_timestamp: nil)
        RubySpy::OTel.finishing(self)
        result = super
        RubySpy::OTel.finished(self)
        result
      end
    end

    # Prepended to +OpenTelemetry::SDK+'s singleton class: the resource is known once configured.
    # @api private
    module ConfigureHook
      def configure(*args, &block)
        result = super
        RubySpy::OTel.publish_process
        result
      end
    end

    # Prepended to +Process+'s singleton class: a forked child publishes its own process context.
    # @api private
    module ForkHook
      def _fork
        pid = super
        RubySpy::OTel.forked if pid.zero?
        pid
      end
    end
  end
end
