# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"

# The heap census of a real Rails app (spec/fixtures/heap_rails.rb: Debian's Rails 6.1 and
# ActiveRecord on sqlite3, parked after GC.start) against the app's own count of every
# object ObjectSpace.each_object yields, by Kernel#class: every class the census names is
# Ruby's count of it, and what Ruby does not yield (hidden objects, iclasses, imemos,
# metaclasses) is in rows named "" under their type, which with the rest make the census's
# total and ObjectSpace.count_objects' per type.
RSpec.describe "the heap census of a Rails app" do
  include RubySpyTest::Recording

  before do
    skip "Debian's Rails and sqlite3 on the host's Ruby" unless RubySpyTest::TargetRuby.current.host?
  end

  it "names every class as the app's own Kernel#class does, and counts each as its each_object does" do
    target = start_target("heap_rails")
    census, answers = target.census_and_answers(timeout: 60)

    # A class whose name is a temporary path (a constant of an anonymous class, which
    # Module#name gives as "#<Class:0x...>::Config") is named anonymous in the census, by
    # its own address (docs/memory.md: the census's rows).
    temporary = answers["classes"].select { |c| c["address"] }
    ruby = answers["classes"].to_h { |c| [c["address"] ? format("#<Class:0x%016x>", c["address"]) : c["name"], c["objects"]] }
    named, hidden = census.classes.partition { |row| row[:name] != "" }
    counted = named.group_by { |row| row[:name] }.transform_values { |rows| rows.sum { |row| row[:objects] } }
    differing = (ruby.keys | counted.keys).reject { |name| ruby[name] == counted[name] }
    warn "Rails #{target.info["rails"]}: census of #{census.objects} objects in #{(census.duration * 1000).round(1)} ms; " \
         "#{ruby.size - differing.size} of #{ruby.size} classes equal (#{ruby.values.sum} objects each_object yields); " \
         "hidden: #{hidden.map { |r| "#{r[:type]} #{r[:objects]}" }.join(", ")}; temporary names: " \
         "#{temporary.map { |c| c["name"] }.join(", ")}"
    expect(differing.to_h { |name| [name, [counted[name], ruby[name]]] }).to eq({})
    expect(ruby.size).to be > 150

    # What each_object does not yield is the rows named "": with the named ones, the census's
    # total, and per type what count_objects counts beyond each_object.
    counts = answers.fetch("counts")
    expect(named.sum { |row| row[:objects] }).to eq(ruby.values.sum)
    expect(named.sum { |row| row[:objects] } + hidden.sum { |row| row[:objects] }).to eq(census.objects)
    live = counts.reject { |type, _| %w[TOTAL FREE T_ZOMBIE T_MOVED].include?(type) }
    expect(census.types.to_h { |t| [t[:type], t[:objects]] }).to eq(live)
    hidden_by_type = hidden.to_h { |row| [row[:type], row[:objects]] }
    answers.fetch("visible").each do |type, visible|
      expect(hidden_by_type.fetch(type, 0)).to eq(counts.fetch(type) - visible), type
    end
    expect(hidden_by_type.fetch("T_CLASS")).to be > 1000 # Rails's classes' metaclasses
    expect(census.slots).to include(unreadable_pages: 0, garbage_slots: 0)
    expect(census.render(:text)).to match(/\(singleton classes\) \(T_CLASS\)/)
  end
end
