# frozen_string_literal: true

module RubySpy
  # Base class of every error RubySpy raises on its own account. Each message says what was
  # found and what to try.
  class Error < StandardError; end

  # No process has the given pid (or it is a zombie with no memory left to read).
  class NoSuchProcess < Error; end

  # The kernel refused to let this process read the target's memory.
  class PermissionDenied < Error; end

  # The process exists, but no Ruby VM was found in it (no libruby and no ruby executable
  # exporting Ruby's symbols, or a VM pointer that does not validate).
  class NotRubyProcess < Error; end

  # The target runs a Ruby whose struct layout RubySpy does not know.
  class UnsupportedVersion < Error; end

  # The target's Ruby is one no table of this build knows, and the debug information that
  # would give its layout is unusable: truncated or corrupt, of another build (its build-id
  # differs), or lacking a member the stack walker needs (the message names it).
  class DebugInfoError < UnsupportedVersion; end

  # The target exited while it was being read.
  class ProcessExited < Error; end

  # The pid no longer holds the process that was attached to: it ran exec (another program,
  # or a fresh Ruby), or it exited and the pid was reused. Nothing read from it is reported as
  # the old process's; attach again to read the new one. A ProcessExited, since the process
  # that was attached to is gone.
  class ProcessReplaced < ProcessExited; end

  # The target's stack kept changing while it was read, and a bounded number of retries did
  # not yield a consistent copy. Taking the snapshot again usually succeeds.
  class StackChanged < Error; end

  # A file given as a raw profile is truncated, corrupt, or not a raw profile at all.
  class InvalidProfile < Error; end

  # A file given as a heap census (+rubyspy heap --diff+, {RubySpy::Census.load}) that is
  # not one: not JSON, or not what +rubyspy heap --output+ writes.
  class InvalidCensus < Error; end

  # Memory that should hold a Ruby structure did not look like one (an internal
  # inconsistency or a layout mismatch); the message names the structure.
  class CorruptMemory < Error; end

  # The spy cannot run on this machine (not Linux, or a kernel without process_vm_readv), so
  # the gem was installed without its native code. Raised by everything that reads a process
  # or a profile; {RubySpy.tag} still runs its block, so code that tags runs unchanged. The
  # message names the platform and why.
  class UnsupportedPlatform < Error; end

  # The in-kernel sampler (+mode: :bpf+, +rubyspy record --bpf+) cannot run: no privilege
  # (root, or CAP_BPF with CAP_PERFMON), a kernel without BTF, the verifier refused the
  # program, or this build of the gem has none. The message says which and what to do; a
  # recording without +mode: :bpf+ still works.
  class BpfUnavailable < Error; end

  # The pprof listener ({Server.start}) could not open its port: another process holds it,
  # or it is below 1024 and this process may not bind it. The message names the address.
  class ListenError < Error; end
end
