# frozen_string_literal: true

# The last line of script/test's summary: what was not run here, and why. First the Rubies
# and JITs that no run had (no registry these machines reach serves a Ruby 4.0 or 4.1, so
# they run only where a developer names one in RUBYSPY_EXTRA_RUBIES), then the examples
# that no run ran, grouped by why they skipped themselves (from the JSON each rspec run
# wrote, tmp/ci/rspec/RUN.json). An example that skips in one run by design and runs in
# another (most of the matrix's: "checked once, on the host's Ruby") was run, and is not
# listed.
#   ruby script/lib/not_run.rb LIST FILE...   (LIST: what `script/rubies list` printed)
require "json"

list = File.readlines(ARGV.shift).map(&:split)
series = list.map { |fields| fields[1][/\A\d+\.\d+/] }
absent = []
missing = %w[4.0 4.1] - series
unless missing.empty?
  absent << "Ruby #{missing.join(' and ')} (no registry here serves one: " \
            "RUBYSPY_EXTRA_RUBIES=/path/to/ruby runs every lane against a Ruby of your own)"
end
absent << "ZJIT (Ruby 4.0+)" unless series.any? { |s| Gem::Version.new(s) >= Gem::Version.new("4.0") }

# Each example (by id: the same in every run) and the reasons it skipped for, nil where it ran.
outcomes = Hash.new { |h, k| h[k] = [] }
ARGV.each do |file|
  JSON.parse(File.read(file)).fetch("examples", []).each do |e|
    outcomes[e["id"]] << (e["status"] == "pending" ? e["pending_message"].to_s.strip : nil)
  end
rescue JSON::ParserError, Errno::ENOENT
  next # a run killed before it wrote its report
end
# Reasons that send an example to another run ("needs Ruby 3.3+", "not by host Ruby",
# "see the JIT runs"), rather than name what is missing here.
ELSEWHERE = /\bneeds? Ruby\b|\bnot by\b|\bsee the\b|\bcovers this\b/
# Of an example's reasons, one that names what is missing, then the most frequent.
never = outcomes.reject { |_, reasons| reasons.include?(nil) }.transform_values do |reasons|
  reasons.tally.max_by { |reason, n| [reason.match?(ELSEWHERE) ? 0 : 1, n] }.first
end
by_reason = never.values.tally.sort_by { |reason, n| [-n, reason] }
parts = absent
unless by_reason.empty?
  parts << "#{never.size} example#{'s' unless never.size == 1} in no run: " +
           by_reason.map { |reason, n| "#{reason.empty? ? '(no reason given)' : reason} (#{n})" }.join("; ")
end
puts "not run here: #{parts.empty? ? 'nothing' : parts.join('; ')}"
