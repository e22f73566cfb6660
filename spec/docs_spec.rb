# frozen_string_literal: true

require_relative "spec_helper"
require "rbconfig"
require "tmpdir"

# Keeps README.md and the guides in docs/ true: every ```ruby block compiles, and runs in a
# child Ruby against a real process (spec/fixtures/docs_worker.rb) unless an HTML comment
# just before it says why not:
#
#   <!-- doc: file config/puma.rb, read by Puma -->     a file of another program: compiled only
#   <!-- doc: not run: needs root and BTF -->           compiled only, for the reason given
#
# A line `EXPR # => LITERAL` whose literal is a string, number, symbol, true, false or nil is
# checked as it runs. Then: the table of docs/environment.md against the variables the code
# reads, relative links and the repository paths the docs mention, and the README's size.
module DocsCheck
  ROOT = RubySpyTest::ROOT
  DOCS = ["README.md", *Dir.children(File.join(ROOT, "docs")).grep(/\.md\z/).sort.map { |f| "docs/#{f}" }].freeze
  MARK = /\A\s*<!--\s*doc:\s*(?<kind>file|not run:)\s*(?<why>\S.*?)\s*-->\s*\z/.freeze
  FENCE = /\A(?<indent>\s*)```(?<lang>[\w-]*)\s*\z/.freeze
  # A checked `# =>`: the expression, then a literal and nothing after it.
  CHECKED = /\A(?<indent>\s*)(?<expr>[^#\s].*?)\s+# => (?<value>true|false|nil|-?\d[\d_]*|"[^"\\]*"|:\w+)\s*\z/.freeze
  # Code the variable table is checked against, and the prefixes of its variables.
  CODE_DIRS = %w[lib ext core exe script spec bench rakelib fuzz .ci].freeze
  VARIABLE = /\b(?:RUBYSPY|RBSPY_EXT)(?:_[A-Z0-9]+)*\b/.freeze

  Block = Struct.new(:doc, :line, :lang, :code, :mark, :indent, keyword_init: true) do
    def where
      "#{doc}:#{line}"
    end

    def run?
      mark.nil?
    end
  end

  module_function

  def read(doc)
    File.read(File.join(ROOT, doc))
  end

  # The fenced blocks of +doc+; +line+ is the line of the block's first line of code. A
  # fence may be indented (inside a list item); its indentation is taken off the code.
  def blocks(doc)
    found = []
    open = nil
    previous = nil
    read(doc).lines.each_with_index do |text, index|
      if open
        if text.strip == "```"
          found << open
          open = nil
        else
          open.code << text.delete_prefix(open.indent)
        end
      elsif (fence = FENCE.match(text.chomp))
        mark = previous && MARK.match(previous)
        open = Block.new(doc: doc, line: index + 2, lang: fence[:lang], code: +"", indent: fence[:indent],
                         mark: mark && "#{mark[:kind]} #{mark[:why]}")
      end
      previous = text unless text.strip.empty?
    end
    found
  end

  # Comments that look like marks but do not parse (a typo would quietly run a block).
  def bad_marks(doc)
    read(doc).lines.each_with_index.filter_map do |text, index|
      "#{doc}:#{index + 1}: #{text.strip}" if text.include?("<!-- doc:") && !MARK.match?(text)
    end
  end

  def ruby_blocks
    DOCS.flat_map { |doc| blocks(doc) }.select { |b| b.lang == "ruby" }
  end

  # The code as the child runs it: each checked `# =>` line becomes a call that compares,
  # on the same line, so errors keep the doc's line numbers.
  def instrumented(code)
    code.lines.map do |text|
      m = CHECKED.match(text.chomp)
      next text unless m

      "#{m[:indent]}__doc_expect((#{m[:expr]}), #{m[:value]}, #{m[:expr].inspect})\n"
    end.join
  end

  # What the child loads before a block: the names the docs use, bound to the worker.
  PRELUDE = <<~'RUBY'
    require "rbspy_ext"

    worker_pid = pid = Integer(ARGV.fetch(0))
    request = Struct.new(:uuid).new("2b7e1d")

    def handle(request)
      request.uuid
    end

    def run_the_slow_thing
      200_000.times.map { |i| (i * 31) % 7 }.sum
    end

    # Some 4 MB of slots: samples at the default rate of one per 512 KiB.
    def import_all
      Array.new(50_000) { |i| { id: i, name: "item #{i}" } }
    end

    def __doc_expect(actual, expected, expression)
      return if actual == expected

      raise "#{expression}: the docs say #{expected.inspect}, it gave #{actual.inspect}"
    end

    doc, line, code = ARGV.fetch(1), Integer(ARGV.fetch(2)), File.read(ARGV.fetch(3))
    eval(code, binding, doc, line) # rubocop:disable Security/Eval
  RUBY

  # Every variable name with one of the two prefixes in the code, and the files naming it.
  def variables_in_code
    files = IO.popen(["git", "-C", ROOT, "ls-files", "-co", "--exclude-standard", "--", *CODE_DIRS,
                      "Rakefile", "rbspy_ext.gemspec"], &:read).split("\n")
    files -= ["spec/docs_spec.rb"] # names the prefixes, reads none
    found = Hash.new { |h, k| h[k] = [] }
    files.each do |file|
      path = File.join(ROOT, file)
      next unless File.file?(path)

      text = File.binread(path)
      next if text.include?("\0")

      text.force_encoding(Encoding::UTF_8).scrub.scan(VARIABLE).uniq.each do |name|
        found[name] << file unless name.end_with?("_H") # C include guards
      end
    end
    found
  end

  def variables_in_table
    read("docs/environment.md").lines.filter_map { |l| l[/\A\|\s*`([A-Z0-9_]+)`\s*\|/, 1] }
  end

  # Relative links: [text](target) and ![alt](target), not inside code.
  def links(doc)
    prose(doc).scan(/!?\[[^\]]*\]\(([^)\s]+)\)/).flatten.reject { |t| t.match?(%r{\A(?:[a-z]+:|#)}) }
  end

  # The text of +doc+ outside its fenced blocks.
  def prose(doc)
    inside = false
    read(doc).lines.select do |text|
      fence = inside ? text.strip == "```" : FENCE.match?(text.chomp)
      inside = !inside if fence
      !inside && !fence
    end.join
  end

  # GitHub's anchor for a heading.
  def anchors(doc)
    prose(doc).lines.grep(/\A#+ /).map do |h|
      h.sub(/\A#+ /, "").strip.downcase.gsub(/[^\p{Word}\- ]/, "").tr(" ", "-")
    end
  end

  # Mentions of repository files: paths starting at one of its top-level directories, or
  # Rust files named by a tail of their path (spy/walker.rs). Patterns (X.Y, NAME, *) and
  # files of other programs (config/puma.rb, Ruby's gc/default/default.c) are not mentions.
  def path_mentions(doc)
    tops = IO.popen(["git", "-C", ROOT, "ls-files"], &:read).split("\n").filter_map { |f| f[%r{\A[^/]+(?=/)}] }.uniq
    read(doc).scan(%r{(?<![\w./:-])((?:\.?[\w-]+/)+[\w.-]*[\w/])}).flatten.uniq.select do |path|
      next false if path.match?(/X\.Y|NAME|VERSION|PATH|\*/)

      tops.include?(path.split("/").first) || path.end_with?(".rs")
    end
  end

  def exists?(doc, path)
    [File.join(ROOT, path), File.join(ROOT, File.dirname(doc), path)].any? { |p| File.exist?(p) } ||
      (path.end_with?(".rs") && tracked_rust.any? { |f| f.end_with?("/#{path}") })
  end

  def tracked_rust
    @tracked_rust ||= IO.popen(["git", "-C", ROOT, "ls-files", "*.rs"], &:read).split("\n")
  end
end

RSpec.describe "README.md and docs/" do
  it "has no malformed <!-- doc: --> marks" do
    expect(DocsCheck::DOCS.flat_map { |doc| DocsCheck.bad_marks(doc) }).to eq([])
  end

  it "has a README of at most 250 lines with both commands, and at least 10 guides" do
    readme = DocsCheck.read("README.md")
    expect(readme.lines.size).to be <= 250
    expect(readme).to include("script/demo").and include("script/test")
    expect(DocsCheck::DOCS.count { |d| d.start_with?("docs/") }).to be >= 10
  end

  describe "every ```ruby block compiles" do
    DocsCheck.ruby_blocks.each do |block|
      it "#{block.where}#{" (#{block.mark})" if block.mark}" do
        expect { RubyVM::InstructionSequence.compile(block.code, block.doc, block.doc, block.line) }
          .not_to raise_error
      end
    end
  end

  describe "every runnable ```ruby block runs against a real process" do
    DocsCheck.ruby_blocks.select(&:run?).each do |block|
      it block.where do
        # The host's Ruby: the examples load the extension built for it (rake compile).
        worker = start_target("docs_worker", ruby: RubySpyTest::TargetRuby.new(nil))
        Dir.mktmpdir("rbspy-docs-") do |dir|
          File.write(File.join(dir, "prelude.rb"), DocsCheck::PRELUDE)
          File.write(File.join(dir, "block.rb"), DocsCheck.instrumented(block.code))
          env = { "RUBYSPY_PPROF_TOKEN" => "docs-spec-token" }
          cmd = [RbConfig.ruby, "-I", File.join(DocsCheck::ROOT, "lib"), "prelude.rb",
                 worker.pid.to_s, block.doc, block.line.to_s, "block.rb"]
          popen_killed_after(env, *cmd, kind: :popen2e, chdir: dir) do |stdin, out, wait|
            stdin.close
            reader = Thread.new { out.read }
            status = exit_status(wait, "the block at #{block.where}", timeout: 120)
            output = reader.value
            expect(status).to be_success, "#{block.where} failed (#{status.inspect}):\n#{output}"
          end
        end
        expect(worker.health_problems).to eq([])
      end
    end
  end

  it "runs most ruby blocks, marking few as not run" do
    blocks = DocsCheck.ruby_blocks
    expect(blocks.count(&:run?)).to be > blocks.count { |b| !b.run? }
  end

  describe "docs/environment.md" do
    let(:in_code) { DocsCheck.variables_in_code }
    let(:in_table) { DocsCheck.variables_in_table }

    it "has a row for every variable the code reads" do
      missing = in_code.keys - in_table
      expect(missing).to eq([]), missing.map { |v| "#{v} (read by #{in_code[v].join(', ')})" }.join("\n")
    end

    it "has no row for a variable nothing reads, and one row each" do
      expect(in_table - in_code.keys).to eq([])
      expect(in_table.tally.select { |_, n| n > 1 }).to eq({})
    end
  end

  describe "links and paths" do
    DocsCheck::DOCS.each do |doc|
      it "#{doc}: every relative link points at a file, and at a heading there" do
        broken = DocsCheck.links(doc).reject do |link|
          path, anchor = link.split("#", 2)
          target = path.empty? ? doc : File.join(File.dirname(doc), path)
          File.exist?(File.join(DocsCheck::ROOT, target)) &&
            (anchor.nil? || !target.end_with?(".md") || DocsCheck.anchors(target).include?(anchor))
        end
        expect(broken).to eq([])
      end

      it "#{doc}: every repository file it mentions exists" do
        expect(DocsCheck.path_mentions(doc).reject { |p| DocsCheck.exists?(doc, p) }).to eq([])
      end
    end
  end
end
