# frozen_string_literal: true

module RubySpyTest
  # The fields of /proc/PATH/stat after the command name ([state, ppid, ...]; PATH "PID" or
  # "PID/task/TID"), nil when it is gone. The name is in parentheses and may itself hold
  # spaces and parentheses.
  def self.stat_fields(path)
    stat = File.read("/proc/#{path}/stat")
    stat[(stat.rindex(")") + 2)..].split
  rescue SystemCallError
    nil
  end

  # Kernel state letter of a process (R, S, D, T, t, Z, ...), nil when there is none.
  def self.process_state(pid)
    stat_fields(pid)&.first
  end

  # What looks wrong with a live process that a read must leave alone: gone, a zombie,
  # stopped, or traced. Empty when it is running normally.
  def self.process_problems(pid)
    fields = File.readlines("/proc/#{pid}/status").to_h { |l| l.chomp.split(":\t", 2) }
    problems = []
    state = fields["State"].to_s
    problems << "process #{pid} is #{state}" if state.start_with?("T", "t", "Z", "X")
    tracer = fields["TracerPid"].to_i
    problems << "process #{pid} is being traced by #{tracer}" unless tracer.zero?
    problems
  rescue SystemCallError
    ["process #{pid} is gone"]
  end
end
