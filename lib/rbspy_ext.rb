# frozen_string_literal: true

require_relative "rbspy_ext/version"
require_relative "rbspy_ext/error"
require_relative "rbspy_ext/frame"

# The compiled extension defines RubySpy::NativeHandle (a live view of one process's Ruby VM),
# NativeRecorder and NativeProfile, which the Ruby classes of the same names without "Native"
# wrap, and the tag states; rbspy_ext/native.rb finds the one for this Ruby (or, where the spy
# cannot run, loads inert stand-ins).
require_relative "rbspy_ext/native"
RubySpy::Native.load!
require_relative "rbspy_ext/handle"
require_relative "rbspy_ext/recorder"
require_relative "rbspy_ext/profile"
require_relative "rbspy_ext/state"
# The Rails integration tags requests and jobs by itself (rbspy_ext/rails.rb); Rack apps use
# RubySpy::Rack::Tags and RubySpy::Rack::Pprof (rbspy_ext/rack.rb), loaded on first use.
require_relative "rbspy_ext/rails" if defined?(Rails::Railtie)

# RubySpy reads the stack of a running Ruby process from its memory, without stopping or
# changing it. See README.md for the tour and ARCHITECTURE.md for how a snapshot is taken.
module RubySpy
  autoload :Rack, File.expand_path("rbspy_ext/rack", __dir__)

  class << self
    # The stack of the thread that holds the GVL in process +pid+ (the main thread when no
    # thread holds it), innermost frame first, exactly as that thread's
    # +Thread#backtrace_locations+ would list it.
    #
    # @param pid [Integer] a process id; +Process.pid+ snapshots the calling process
    # @return [Array<RubySpy::Frame>]
    # @raise [TypeError] if +pid+ is not an Integer
    # @raise [ArgumentError] if +pid+ is not positive
    # @raise [RubySpy::Error] (a subclass naming the cause) when the process cannot be read
    # @example
    #   RubySpy.snapshot(worker_pid).each { |frame| puts frame }
    def snapshot(pid)
      attach(pid).snapshot
    end

    # Opens a reusable handle on process +pid+. The handle finds the Ruby VM once and caches
    # what cannot change (addresses, struct layout, method names, line tables), so repeated
    # snapshots through it cost a few memory reads each.
    #
    # @param pid [Integer]
    # @param force_version [String, nil] use this release's layout instead of the reported one
    # @return [RubySpy::Handle]
    # @raise (see .snapshot)
    def attach(pid, force_version: nil)
      Handle.new(pid, force_version: force_version)
    end
  end
end
