# frozen_string_literal: true

require_relative "spec_helper"
require "fileutils"
require "json"
require "open3"
require "rbspy_ext"
require "tmpdir"
require "zlib"

# Layouts read from a Ruby's own debug information (core/src/dwarf/): the Rubies built here
# from Debian's source tarballs carry full DWARF, as rbenv's do; src-3.4-bp is 3.4.5 with
# VM_DEBUG_BP_CHECK, whose control frames are a word longer than any table says. Each is
# read from the binary itself, from a separate debug file found by build-id or by
# .gnu_debuglink, and refused with a reason when its debug information is wrong. Every read
# that must find the debug information afresh runs in a process of its own with a cache of
# its own: layouts are kept by build-id, which a stripped copy shares.
RSpec.describe "layouts from debug information" do
  SpiedFrame = Struct.new(:label, :base_label, :path, :absolute_path, :lineno, keyword_init: true)

  rubies = IO.popen([File.join(RubySpyTest::ROOT, "script", "rubies"), "list"], &:read).lines.map(&:split)
                                                                                          .select { |f| %w[source source-unknown extra].include?(f[4]) }
                                                                                          .select { |f| IO.popen(["readelf", "-S", f[3]], err: File::NULL, &:read).include?(".debug_info") }

  if rubies.empty?
    it "has Rubies with debug information to read (script/rubies build builds them from Debian's source tarballs)" do
      skip "no Ruby with DWARF built here: script/rubies build src-3.4 src-3.4-bp"
    end
  end

  # `RubySpy.attach(pid)`'s layout, or the error, and a snapshot, in a process of its own.
  def read_afresh(pid, env = {})
    script = <<~RUBY
      require "rbspy_ext"
      require "json"
      begin
        handle = RubySpy.attach(#{pid})
        frames = handle.snapshot.map { |f| %i[label base_label path absolute_path lineno].to_h { |k| [k, f.public_send(k)] } }
        puts JSON.generate(layout: handle.layout, frames: frames)
      rescue RubySpy::Error => e
        puts JSON.generate(error: e.class.name, message: e.message)
      end
    RUBY
    out, err, status = Open3.capture3({ "RUBYSPY_LAYOUT_CACHE" => @cache }.merge(env), RbConfig.ruby,
                                      "-I", File.join(RubySpyTest::ROOT, "lib"), "-e", script)
    expect(status).to be_success, err
    JSON.parse(out, symbolize_names: true)
  end

  def frames_of(result)
    result.fetch(:frames).map { |f| SpiedFrame.new(**f) }
  end

  # Where a debug-file-directory under @dir keeps the debug file of build-id +id+.
  def by_build_id(id)
    File.join(@dir, "debug", ".build-id", id[0, 2], "#{id[2..]}.debug").tap { |f| FileUtils.mkdir_p(File.dirname(f)) }
  end

  def build_id(bin)
    IO.popen(["readelf", "-n", bin], &:read)[/Build ID: (\h+)/, 1]
  end

  def gdb(bin, expression)
    out = IO.popen(["gdb", "-batch", "-nx", "-ex", "print (unsigned long)(#{expression})", bin], err: File::NULL, &:read)
    Integer(out[/\$1 = (\d+)/, 1] || raise("gdb could not print #{expression}: #{out}"))
  end

  around do |example|
    Dir.mktmpdir("rbspy-layouts-") do |dir|
      @cache = File.join(dir, "cache")
      @dir = dir
      example.run
    end
  end

  rubies.each do |name, version, _dir, bin, kind|
    table = "#{version.split(".").first(2).join(".")}"
    describe "Ruby #{version} (#{name}, #{kind})" do
      it "is read with its own debug information, which gdb and (where it has one) the table agree with" do
        target = start_target("nested_methods", ruby: RubySpyTest::BinaryRuby.new(bin))
        out, err, status = Open3.capture3({ "RUBYSPY_LAYOUT_CACHE" => @cache }, RbConfig.ruby, "-I",
                                          File.join(RubySpyTest::ROOT, "lib"), File.join(RubySpyTest::ROOT, "exe", "rubyspy"),
                                          "layout", "--pid", target.pid.to_s)
        expect(status).to be_success, err
        lines = out.lines.map(&:chomp)
        expect(lines[0]).to eq("source: debug info #{bin} (build-id #{build_id(bin)})")
        case kind
        when "source" then expect(lines[1]).to eq("table #{table} agrees")
        when "source-unknown" then expect(lines[1]).to eq("table #{table} differs: cfp_size")
        end
        # The heap census's layout, from the same DWARF: gc.c's structs are the series' own.
        expect(lines[2]).to eq("heap: debug info; its series' table agrees") unless kind == "extra"
        fields = lines.drop(2).to_h { |l| l.split(" ", 2) }
        # gdb reads the same DWARF its own way: an oracle for a few fields of each kind.
        { "cfp_size" => "sizeof(rb_control_frame_t)", "thread_ec" => "&((rb_thread_t *)0)->ec",
          "body_local_iseq" => "&((struct rb_iseq_constant_body *)0)->local_iseq",
          "qnil" => "RUBY_Qnil", "frame_magic_mask" => "VM_FRAME_MAGIC_MASK" }.each do |field, expr|
          expect(Integer(fields.fetch(field))).to eq(gdb(bin, expr)), field
        end
        expect(Dir[File.join(@cache, "*.layout")].map { |f| File.basename(f, ".layout") }).to eq([build_id(bin)])
        expect(read_afresh(target.pid)[:layout]).to include(source: "debug_info", cached: true, path: bin,
                                                             heap: "debug_info", heap_differs: [])

        # A profile says so too: its notes, which pprof keeps as comments and the Firefox
        # format in its meta.
        out = File.join(@dir, "profile")
        _, err, status = Open3.capture3({ "RUBYSPY_LAYOUT_CACHE" => @cache }, RbConfig.ruby, "-I",
                                        File.join(RubySpyTest::ROOT, "lib"), File.join(RubySpyTest::ROOT, "exe", "rubyspy"),
                                        "record", "--pid", target.pid.to_s, "--duration", "0.3",
                                        "-f", "raw", "-f", "pprof", "-f", "firefox", "-o", out)
        expect(status).to be_success, err
        note = "layout #{lines.take_while { |l| l.match?(/\A(source:|table |heap:)/) }.join("; ")}"
        expect(RubySpy::Profile.load("#{out}.raw").notes).to include(note)
        written = Dir["#{out}.*"].to_h { |f| [File.basename(f).delete_prefix("profile."), f] }
        expect(written.keys).to contain_exactly("raw", "pb.gz", "json.gz")
        expect(Zlib.gunzip(File.binread(written["pb.gz"]))).to include(note)
        expect(JSON.parse(Zlib.gunzip(File.binread(written["json.gz"])))["meta"].to_s).to include(note)
      end

      it "reads a program 40 frames deep through blocks, methods, C calls and eval exactly" do
        target = start_target("deep_mixed", ruby: RubySpyTest::BinaryRuby.new(bin))
        expect(target.frames.size).to be >= 40
        result = read_afresh(target.pid)
        expect(result[:layout]).to include(source: "debug_info")
        expect(frames_of(result)).to match_backtrace(target.frames, ruby_version: version)
        expect(RubySpy.snapshot(target.pid)).to match_backtrace(target.frames, ruby_version: version)
      end

      it "with its debug information removed, is read by the table or refused, never wrongly" do
        stripped = File.join(@dir, "ruby")
        system("objcopy", "--strip-debug", bin, stripped, exception: true)
        target = start_target("nested_methods", ruby: RubySpyTest::BinaryRuby.new(stripped))
        # Past its start-up (attach.rs): a layout that does not fit is then the wrong one.
        wait_for("the target to be past its start-up") { process_age(target.pid) > 2.2 }
        result = read_afresh(target.pid)
        if kind == "source-unknown"
          expect(result).to include(error: "RubySpy::UnsupportedVersion")
          expect(result[:message]).to match(/does not fit the layout this build has for #{Regexp.escape(version)}/)
        else
          expect(result[:layout]).to include(source: "table", table: table)
          expect(frames_of(result)).to match_backtrace(target.frames, ruby_version: version)
        end
        # The same build (its build-id) read once with its DWARF: the kept layout serves.
        read_afresh(start_target("nested_methods", ruby: RubySpyTest::BinaryRuby.new(bin)).pid)
        kept = read_afresh(target.pid)
        expect(kept[:layout]).to include(source: "debug_info", cached: true)
        expect(frames_of(kept)).to match_backtrace(target.frames, ruby_version: version)
      end

      it "finds a separate debug file by build-id and by .gnu_debuglink, as distributions ship them" do
        debug = File.join(@dir, "ruby.debug")
        system("objcopy", "--only-keep-debug", bin, debug, exception: true)
        # By build-id under a debug-file-directory (gdb's; /usr/lib/debug by default).
        id = build_id(bin)
        by_id = by_build_id(id)
        FileUtils.cp(debug, by_id)
        bare = File.join(@dir, "bare", "ruby")
        FileUtils.mkdir_p(File.dirname(bare))
        system("objcopy", "--strip-debug", bin, bare, exception: true)
        target = start_target("deep_mixed", ruby: RubySpyTest::BinaryRuby.new(bare))
        result = read_afresh(target.pid, "RUBYSPY_DEBUG_FILE_DIRECTORY" => File.join(@dir, "debug"))
        expect(result[:layout]).to include(source: "debug_info", path: "/proc/#{target.pid}/root#{by_id}")
        expect(frames_of(result)).to match_backtrace(target.frames, ruby_version: version)

        # By .gnu_debuglink, in .debug/ beside the binary, CRC-checked.
        linked = File.join(@dir, "linked", "ruby")
        FileUtils.mkdir_p(File.join(@dir, "linked", ".debug"))
        FileUtils.cp(debug, File.join(@dir, "linked", ".debug", "ruby.debug"))
        Dir.chdir(File.join(@dir, "linked", ".debug")) do
          system("objcopy", "--strip-debug", "--remove-section=.note.gnu.build-id", "--add-gnu-debuglink=ruby.debug",
                 bin, linked, exception: true)
        end
        target = start_target("deep_mixed", ruby: RubySpyTest::BinaryRuby.new(linked))
        result = read_afresh(target.pid)
        expect(result[:layout]).to include(source: "debug_info", path: "/proc/#{target.pid}/root#{File.join(@dir, "linked", ".debug", "ruby.debug")}")
        expect(frames_of(result)).to match_backtrace(target.frames, ruby_version: version)
      end

      it "reads debug sections compressed with zlib and with zstd" do
        %w[zlib zstd].each do |method|
          compressed = File.join(@dir, "ruby-#{method}")
          system("objcopy", "--compress-debug-sections=#{method}", bin, compressed, exception: true)
          expect(IO.popen(["readelf", "-S", "-W", compressed], &:read)[/\.debug_info .*/]).to match(/ C /)
          target = start_target("deep_mixed", ruby: RubySpyTest::BinaryRuby.new(compressed))
          # A cache of its own: the copies share the build-id, whose layout is kept.
          result = read_afresh(target.pid, "RUBYSPY_LAYOUT_CACHE" => File.join(@dir, "cache-#{method}"))
          expect(result[:layout]).to include(source: "debug_info", path: compressed, heap: "debug_info", cached: false)
          expect(frames_of(result)).to match_backtrace(target.frames, ruby_version: version)
        end
      end

      it "refuses a debug file of another build, a truncated one, and one without Ruby's types, saying which" do
        bare = File.join(@dir, "ruby")
        system("objcopy", "--strip-debug", bin, bare, exception: true)
        id = build_id(bin)
        by_id = by_build_id(id)
        env = { "RUBYSPY_DEBUG_FILE_DIRECTORY" => File.join(@dir, "debug") }
        target = start_target("nested_methods", ruby: RubySpyTest::BinaryRuby.new(bare))
        other = rubies.find { |r| r[3] != bin && build_id(r[3]) != id }
        # A C program with debug information and the binary's very build-id.
        source = File.join(@dir, "hello.c")
        File.write(source, "int main(void) { return 0; }\n")
        impostor = File.join(@dir, "impostor")
        system("cc", "-g", "-o", impostor, source, "-Wl,--build-id=0x#{id}", exception: true)
        debug = File.join(@dir, "ruby.debug")
        system("objcopy", "--only-keep-debug", bin, debug, exception: true)
        truncated = File.binread(debug, File.size(debug) / 2)
        cases = { impostor => /lacks rb_vm_t\.ractor\.main_thread or rb_vm_t\.main_thread, for vm_main_thread/,
                  "truncated" => /not an ELF file|does not parse|section/ }
        cases[other[3]] = /build-id \h+ is not the binary's #{id}: it belongs to another build/ if other
        cases.each do |file, reason|
          file == "truncated" ? File.binwrite(by_id, truncated) : FileUtils.cp(file, by_id)
          system("objcopy", "--only-keep-debug", file, by_id, exception: true) if file == other&.at(3)
          result = read_afresh(target.pid, env)
          if kind == "source-unknown"
            expect(result).to include(error: "RubySpy::DebugInfoError"), "#{file}: #{result}"
            expect(result[:message]).to match(reason).and include(by_id)
          else
            expect(result[:layout]).to include(source: "table", table: table), "#{file}: #{result}"
            expect(result[:layout][:unusable]).to match(reason).and include(by_id)
            expect(frames_of(result)).to match_backtrace(target.frames, ruby_version: version)
          end
        end
      end
    end
  end
end
