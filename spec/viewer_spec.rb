# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "json"
require "open3"
require "tmpdir"

# Our speedscope and timeline files opened in the real speedscope app (npm's `speedscope`
# package, which script/setup installs with puppeteer-core under ~/.cache/rbspy_ext/viewer)
# in Debian's headless Chromium: spec/support/viewer/check.js loads each file through
# #profileURL=, takes a screenshot, and reads back the text the app rendered. The flame
# charts are drawn on a canvas, so frame names are read from the sandwich view's table.
# First each file is validated against the JSON schema of speedscope's file format that the
# package ships (dist/release/file-format-schema.json), by Debian's python3-jsonschema.
RSpec.describe "profiles in the speedscope viewer" do
  VIEWER = File.join(ENV.fetch("XDG_CACHE_HOME", File.join(Dir.home, ".cache")), "rbspy_ext", "viewer")
  CHROMIUM = "/usr/bin/chromium"

  before(:all) do
    release = File.join(VIEWER, "node_modules", "speedscope", "dist", "release", "index.html")
    skip "the speedscope viewer is not installed (script/setup installs it)" unless File.exist?(release)
    skip "chromium is not installed (script/setup installs it)" unless File.executable?(CHROMIUM)
    @dir = Dir.mktmpdir("rubyspy-viewer")
  end

  after(:all) { FileUtils.rm_rf(@dir) if @dir }

  before { skip "the extension is built for the host Ruby" unless RubySpyTest::TargetRuby.current.host? }

  # The schema's complaints about the document +doc+ (none when it is valid), from
  # python3-jsonschema with the draft the schema names.
  def schema_problems(doc)
    schema = File.join(VIEWER, "node_modules", "speedscope", "dist", "release", "file-format-schema.json")
    check = <<~PY
      import json, sys
      import jsonschema
      schema = json.load(open(sys.argv[1]))
      validator = jsonschema.validators.validator_for(schema)(schema)
      for error in validator.iter_errors(json.load(sys.stdin)):
          print("/".join(map(str, error.absolute_path)) + ": " + error.message[:200])
    PY
    out, err, status = Open3.capture3("python3", "-c", check, schema, stdin_data: JSON.generate(doc))
    raise "python3-jsonschema failed (script/setup installs it): #{err}" unless status.success?

    out.lines.map(&:chomp)
  end

  # +file+ is valid against speedscope's schema, and the check can fail: the same document
  # with a unit the schema does not know is not (its profiles match none of the schema's
  # profile kinds).
  def expect_valid_speedscope(file)
    doc = JSON.parse(File.read(file))
    expect(schema_problems(doc)).to eq([])
    bad = doc.merge("profiles" => doc["profiles"].map { |p| p.merge("unit" => "furlongs") })
    expect(schema_problems(bad)).to include(a_string_starting_with("profiles/0: "))
  end

  # What the app showed for +file+: {"title", "timeOrder", "sandwich", "errors"}.
  def open_in_viewer(file)
    screenshot = file.sub(/\.json\z/, ".png")
    out, err, status = Open3.capture3({ "NODE_PATH" => File.join(VIEWER, "node_modules") }, "node",
                                      File.join(__dir__, "support", "viewer", "check.js"),
                                      File.join(VIEWER, "node_modules", "speedscope", "dist", "release"),
                                      file, screenshot, CHROMIUM)
    expect(status.success?).to be(true), err
    png = File.binread(screenshot)
    expect(png.byteslice(0, 8)).to eq("\x89PNG\r\n\x1a\n".b)
    expect(png.bytesize).to be > 10_000 # a drawn page, not an empty one
    JSON.parse(out)
  end

  it "speedscope: the file is valid against the app's schema, which loads it and lists our functions" do
    target = start_target("named_worker")
    profile = RubySpy.record(target.pid, rate: 200, duration: 1)
    file = File.join(@dir, "worker.speedscope.json")
    profile.write(file, format: :speedscope)
    expect_valid_speedscope(file)
    shown = open_in_viewer(file)
    expect(shown["errors"]).to eq([])
    expect(shown["title"]).to start_with("rbspy_ext: pid #{target.pid}")
    expect(shown["timeOrder"]).to include("All threads")
    expect(shown["sandwich"]).to match(/\tCrunch#digest$/)
    expect(shown["sandwich"]).not_to include("Kernel#sleep") # the sleeping main thread is idle
  end

  it "timeline: valid against the schema; the app loads one evented profile per thread, with states and functions" do
    target = start_target("gvl_contention")
    profile = RubySpy.record(target.pid, rate: 200, duration: 1)
    file = File.join(@dir, "contention.timeline.speedscope.json")
    profile.write(file, format: :timeline)
    doc = JSON.parse(File.read(file))
    busiest = doc["profiles"][doc["activeProfileIndex"]]["name"]
    expect_valid_speedscope(file)
    shown = open_in_viewer(file)
    expect(shown["errors"]).to eq([])
    expect(shown["title"]).to start_with("rbspy_ext timeline: pid #{target.pid}")
    expect(shown["timeOrder"]).to include("#{busiest} (#{doc["activeProfileIndex"] + 1}/3)")
    # The spinners take turns with the GVL: both states show, over Contender#spin.
    expect(busiest).to match(/spinner-[ab]/)
    expect(shown["sandwich"]).to match(/\t\[running\]$/).and match(/\t\[waiting_for_gvl\]$/)
    expect(shown["sandwich"]).to match(/\tContender#spin$/)
  end
end
