# frozen_string_literal: true

# The last line of script/test's summary: what was not run here, and why. First the Rubies
# and JITs that no lane ran (no registry these machines reach serves a Ruby 4.0 or 4.1, so
# they run only where a developer names one in RUBYSPY_EXTRA_RUBIES), then every example
# that skipped itself, grouped by its reason, with how many skipped and in which runs (from
# the JSON each rspec run wrote, tmp/ci/rspec/RUN.json).
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

skipped = Hash.new { |h, k| h[k] = [0, []] }
ARGV.each do |file|
  run = File.basename(file, ".json")
  JSON.parse(File.read(file)).fetch("examples", []).each do |e|
    next unless e["status"] == "pending"

    # One reason whatever the run: the target named in a message is the run's.
    reason = e["pending_message"].to_s.sub(/\ANo reason given\z/, "").strip
    reason = "(no reason given)" if reason.empty?
    skipped[reason][0] += 1
    skipped[reason][1] |= [run]
  end
rescue JSON::ParserError, Errno::ENOENT
  next # a run killed before it wrote its report
end
examples = skipped.sort_by { |_, (n, _)| -n }.map do |reason, (n, runs)|
  shown = runs.size > 3 ? "#{runs.first(3).join(', ')} and #{runs.size - 3} more" : runs.join(", ")
  "#{reason} (#{n} in #{shown})"
end
parts = absent
parts << "#{skipped.sum { |_, (n, _)| n }} examples skipped: #{examples.join('; ')}" unless skipped.empty?
puts "not run here: #{parts.empty? ? 'nothing' : parts.join('; ')}"
