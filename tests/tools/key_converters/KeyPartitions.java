// Where Kafka's default partitioner puts the key of an outbox event that a Debezium connector
// wrote, for each key converter: reads one aggregate id a line on stdin, writes one line each:
//   id <TAB> partition with StringConverter <TAB> JsonConverter, schemas.enable=false
//      <TAB> JsonConverter, schemas.enable=true
// The key's Connect schema is a required string, as the Outbox Event Router gives for an
// aggregateid column declared NOT NULL. The partition is Kafka's own rule for a keyed record:
// toPositive(murmur2(key bytes)) % partitions (BuiltInPartitioner.partitionForKey).
// Run with `java -cp JARS KeyPartitions.java PARTITIONS` (Java 11+ runs a source file).

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.Map;
import org.apache.kafka.common.utils.Utils;
import org.apache.kafka.connect.data.Schema;
import org.apache.kafka.connect.json.JsonConverter;
import org.apache.kafka.connect.storage.Converter;
import org.apache.kafka.connect.storage.StringConverter;

public class KeyPartitions {
    public static void main(String[] args) throws Exception {
        int partitions = Integer.parseInt(args[0]);
        Converter string = new StringConverter();
        string.configure(Map.of(), true);
        Converter json = new JsonConverter();
        json.configure(Map.of("schemas.enable", "false", "converter.type", "key"), true);
        Converter jsonWithSchema = new JsonConverter();
        jsonWithSchema.configure(Map.of("schemas.enable", "true", "converter.type", "key"), true);
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        for (String id; (id = in.readLine()) != null; ) {
            System.out.println(String.join("\t", id,
                partition(string, id, partitions),
                partition(json, id, partitions),
                partition(jsonWithSchema, id, partitions)));
        }
    }

    private static String partition(Converter converter, String id, int partitions) {
        byte[] key = converter.fromConnectData("topic", Schema.STRING_SCHEMA, id);
        return Integer.toString(Utils.toPositive(Utils.murmur2(key)) % partitions);
    }
}
